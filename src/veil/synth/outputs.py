"""What a ``veil synth`` run writes: the synthetic table (CSV, Parquet) and its report.

The table and the report's private sections are post-processing of the run's noisy measurements:
safe to release under the stated guarantee. The ``non_private`` section compares with the real
table (no noise) and is internal.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from veil.mechanisms.rng import RandomSource
from veil.synth.domain import MISSING, Domain
from veil.tables.schema import TableSchema

__all__ = ["build_report", "decode", "render_report", "table_files"]


def decode(codes: np.ndarray, domain: Domain, rng: RandomSource) -> dict[str, list[Any]]:
    """Synthetic codes as column values: level text, numbers drawn uniformly inside their bin, None."""
    out: dict[str, list[Any]] = {}
    for j, a in enumerate(domain.attributes):
        col = codes[:, j]
        if a.kind == "numeric":
            assert a.bounds is not None
            lo, hi = a.bounds
            width = (hi - lo) / a.bins
            # Inside the bin, away from its edges, so that re-reading the table gives the same bin.
            inside = 0.001 + 0.998 * rng.uniform(col.size)
            values = lo + (np.minimum(col, a.bins - 1) + inside) * width
            out[a.name] = [
                None if c >= a.bins else float(f"{v:.6g}") for c, v in zip(col, values, strict=True)
            ]
        else:
            labels = [None if lab == MISSING else lab for lab in a.labels]
            out[a.name] = [labels[c] for c in col]
    return out


def _csv(columns: dict[str, list[Any]], missing: str) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    names = list(columns)
    writer.writerow(names)
    for row in zip(*(columns[n] for n in names), strict=True):
        writer.writerow([missing if v is None else (f"{v:g}" if isinstance(v, float) else v) for v in row])
    return buf.getvalue()


def _parquet(columns: dict[str, list[Any]], domain: Domain) -> bytes | None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        return None
    numeric = {a.name for a in domain.attributes if a.kind == "numeric"}
    arrays = {
        name: pa.array(values, pa.float64() if name in numeric else pa.string())
        for name, values in columns.items()
    }
    sink = io.BytesIO()
    pq.write_table(pa.table(arrays), sink)
    return sink.getvalue()


def table_files(codes: np.ndarray, domain: Domain, schema: TableSchema, rng: RandomSource) -> dict[str, Any]:
    """``synthetic.csv`` (missing cells written as the schema's first missing token) and Parquet.

    Every column of the schema is written, in its order, so the same schema reads the table back;
    text and ignored columns (never read into the model) are left empty."""
    decoded = decode(codes, domain, rng)
    empty = [None] * codes.shape[0]
    columns = {c.name: decoded.get(c.name, empty) for c in schema.columns}
    missing = "" if "" in schema.missing_values or not schema.missing_values else schema.missing_values[0]
    files: dict[str, Any] = {"synthetic.csv": _csv(columns, missing)}
    parquet = _parquet(columns, domain)
    if parquet is not None:
        files["synthetic.parquet"] = parquet
    return files


def _event_row(label: str, event: Any) -> dict[str, Any]:
    from veil.synth.measure import event_rho

    row = {"label": label, **event.to_dict(), "rho": event_rho(event)}
    return row


def build_report(
    settings: Any,
    domain: Domain,
    real: np.ndarray,
    fit: Any,
    rho: float,
    spent: float,
    seconds: float,
    out: Path,
    table_names: list[str],
    checks_on_n: list[str],
) -> dict[str, Any]:
    """The report: guarantee, what was measured (private) and utility against the real data (internal);
    ``checks_on_n`` (:func:`veil.synth.run.checks_on_n`) go to the internal section only."""
    import veil
    from veil.tables.sources import parse_source  # describe(): the password of a SQL URL hidden

    names = domain.names
    secure = settings.secure_rng
    randomness = (
        "secure (OS CSPRNG)" if secure else f"seeded (research mode, not for release), seed {settings.seed}"
    )
    checks = _checks(settings, spent, randomness)
    return _envelope(
        out,
        settings,
        _statement(settings, fit, spent),
        secure and checks[0]["passed"],
        checks,
        _non_private(domain, real, fit, checks_on_n),
        table_names,
        {
            "veil_version": veil.__version__,
            "mechanism": settings.mechanism,
            "dataset": parse_source(settings.dataset, table=settings.table, query=settings.query).describe(),
            "schema": str(settings.schema),
            "out_dir": str(out),
            "epsilon": spent,
            "epsilon_target": settings.epsilon,
            "delta": settings.delta,
            "rho": rho,
            "rho_spent": fit.spend.rho,
            "accountant": "rdp",
            "neighbouring": "add_or_remove_one"
            if settings.privacy_unit is None
            else "add_or_remove_one_unit",
            "privacy_unit": settings.privacy_unit,
            "randomness": randomness,
            "secure_rng": secure,
            "release_ready": secure and checks[0]["passed"],
            "rows_written": int(fit.codes.shape[0]),
            "rows_estimated": fit.total,
            "domain": {
                "columns": [{"name": a.name, "kind": a.kind, "cells": a.size} for a in domain.attributes],
                "cells": float(domain.cells),
                "bins": settings.bins,
            },
            "model": {
                "cliques": [[names[a] for a in c] for c in fit.model.tree.cliques],
                "cells": int(sum(b.size for b in fit.model.theta)),
            },
            "events": [_event_row(label, e) for label, e in fit.spend.events],
            "marginals": _marginals(names, fit),
            "duration_s": seconds,
        },
    )


def _marginals(names: list[str], fit: Any) -> list[dict[str, Any]]:
    """Each measured marginal: its columns, cells, noise std and the total-variation error the noise
    alone is expected to cause (post-processing of the noisy total)."""
    total = fit.total
    return [
        {
            "columns": [names[a] for a in clique],
            "cells": cells,
            "noise_std": std,
            "expected_noise_tv": math.sqrt(2 / math.pi) * std * cells / (2 * total),
        }
        for clique, std, cells in fit.measured
    ]


def _statement(settings: Any, fit: Any, spent: float) -> str:
    """The guarantee in words: (ε, δ), what it covers, the neighbouring relation, the mechanisms."""
    kinds = [e for _, e in fit.spend.events]
    return (
        f"({spent:.4g}, {settings.delta:g})-differential privacy for the synthetic table and this report's "
        "private sections, under adding or removing "
        + (
            "one row of the table (a person with several rows gets weaker protection)"
            if settings.privacy_unit is None
            else f"any one person with all their rows: each person (unit column `{settings.privacy_unit}`), "
            "whatever number of rows they have"
        )
        + ", for the columns the schema "
        f"uses; {settings.mechanism.upper()} with {sum(k.kind == 'gaussian' for k in kinds)} Gaussian "
        f"measurements and {sum(k.kind == 'exponential_mechanism' for k in kinds)} exponential-mechanism "
        "selections, composed as zCDP/RDP and converted to (ε, δ)."
    )


def _checks(settings: Any, spent: float, randomness: str) -> list[dict[str, Any]]:
    """The report's checklist (ε within the target first: release readiness reads it)."""
    return [
        {"name": "ε within target", "passed": spent <= settings.epsilon * (1 + 1e-9),
         "detail": f"composed ε = {spent:.6g} ≤ {settings.epsilon:g} at δ = {settings.delta:g}"},
        {"name": "randomness", "passed": settings.secure_rng, "detail": randomness},
        {"name": "ledger", "passed": True, "detail": "each event fsync'ed to ledger.jsonl on release"},
    ]  # fmt: skip


def _non_private(domain: Domain, real: np.ndarray, fit: Any, checks_on_n: list[str]) -> dict[str, Any]:
    """Utility against the real table and the checks against its exact size, computed without noise:
    internal, never released."""
    from veil.synth.utility import marginal_tv, mean_tv

    sizes, limit = domain.sizes, 500
    return {
        "internal": True,
        "note": "computed from the real table without noise: NOT private, do not release",
        "rows": int(real.shape[0]),
        "checks_on_n": list(checks_on_n),
        "mean_tv": {str(k): mean_tv(real, fit.codes, sizes, k, limit) for k in (1, 2, 3)},
        "measured_tv": [marginal_tv(real, fit.codes, sizes, c) for c, _, _ in fit.measured],
    }


_RELEASED = ("rows_estimated", "model", "marginals", "events")
"""Fields computed from the noisy measurements (post-processing of the ledger's events)."""


def _envelope(
    out: Path,
    settings: Any,
    statement: str,
    ready: bool,
    checks: list[dict[str, Any]],
    non_private: dict[str, Any],
    table_names: list[str],
    body: dict[str, Any],
) -> dict[str, Any]:
    """The report in the common schema (:mod:`veil.report.schema`)."""
    from veil.accounting.ledger import Ledger
    from veil.registry.charge import budget_section_for
    from veil.report.publish import plain_summary
    from veil.report.schema import Evidence, Guarantee, ReportBuilder

    ledger = Ledger.open(out / "ledger.jsonl")
    events = ledger.events()
    evidence = Evidence.of("ledger.jsonl", events)
    guarantee = Guarantee(
        epsilon=body["epsilon"],
        delta=body["delta"],
        unit="row" if body["privacy_unit"] is None else "privacy unit",
        neighbouring=body["neighbouring"],
        accountant="rdp",
        covers="the synthetic table and this report's private sections (post-processing of the noisy "
        "measurements in the ledger); not the non_private section",
        randomness="secure" if body["secure_rng"] else "seeded",
        release_ready=ready,
        statement=statement,
        evidence=evidence,
        extra={"target_epsilon": body["epsilon_target"]},
    )
    b = ReportBuilder("synth", guarantee)
    for key in _RELEASED:
        b.released(key, body.pop(key), evidence)
    b.public_fields(body)
    b.non_private_fields({**non_private, "test_accuracy": None})
    for name in table_names:
        b.file(name, "the synthetic table", release=True)
    b.file("report.json", "this report (the full internal one: its non_private section is internal)")
    b.file("report.html", "the same, for people")
    b.file("ledger.jsonl", "every privacy event, hash-chained")
    b.file(
        "release", "what the guarantee covers, publishable as is: the synthetic table and the public report"
    )
    b.release_file("report.json").release_file("report.html").checks(checks)
    b.dataset_budget = budget_section_for(ledger.header.get("budget_run_id"), events, out)
    b.summary = plain_summary(guarantee.to_dict(), b.dataset_budget, "the synthetic table")
    return b.build()


def render_report(report: dict[str, Any]) -> str:
    from veil.report.render import render_page

    return render_page(
        "synth.html.j2",
        {},
        r=report,
        checks=report["checks"],
        files=report["files"],
        summary=report["summary"],
        dataset_budget=report["dataset_budget"],
    )
