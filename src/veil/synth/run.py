"""``veil synth``: a differentially private synthetic table from a table and its reviewed schema.

Order of work (everything that can refuse runs before anything is written or charged):

1. settings, schema (reviewed), public domain from the schema, size checks on the domain, a first
   noise the sampler can draw (:func:`check_noise_scale`: from ε, δ and the domain alone);
2. the run folder must be new; the run is charged to the dataset's privacy budget (``veil budget``):
   its whole zCDP budget ρ is reserved, or the run refused, before a row is read, and the charge is
   settled to the ledger's events at the end — once a row is read, a run that stops (any error) stays
   charged with its plan, never released; the table is read and encoded (the header was checked
   against the schema before the charge: :func:`veil.data.check_names`). N is private here: δ
   against 1/N and the 1-way noise against N are notes in the internal report (:func:`checks_on_n`),
   never a refusal or a message;
3. the ledger is created, then the mechanism runs, each event appended to the ledger (fsync'ed)
   as it is released; the (ε, δ) is the RDP accountant's composition of the ledger's events and is
   checked against the target before any output is written;
4. outputs: ``synthetic.csv`` (and ``synthetic.parquet`` with pyarrow), ``report.json``,
   ``report.html``, written atomically.

Guarantee: (ε, δ)-DP for the synthetic table and the report's private sections, under add/remove-one
row (or one person with all their rows, with ``privacy_unit``: :mod:`veil.synth.units`), for the
columns the schema uses (text and ignored columns are neither read into the model nor
written). The report's ``non_private`` section compares the synthetic table with the real one: it is
computed from the private data without noise and is internal.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from veil.errors import DataError, InvalidParameterError
from veil.synth.domain import Domain, codes_from_features, domain_from_schema
from veil.synth.settings import SynthSettings

__all__ = ["check_domain", "check_noise_scale", "checks_on_n", "read_codes", "run_synth"]


def check_domain(domain: Domain, settings: SynthSettings) -> None:
    """Refuse a domain whose model cannot fit in ``max_cells`` (sizes are public: the schema's)."""
    sizes = domain.sizes
    limit = settings.max_cells
    d = len(sizes)
    if d < 2:
        return
    pairs = sorted(((sizes[i] * sizes[j], i, j) for i in range(d) for j in range(i + 1, d)), reverse=True)
    big, i, j = pairs[0]
    tree = sum(p for p, _, _ in pairs[: d - 1]) + sum(sizes)
    if big > limit or (settings.mechanism == "mst" and tree > limit):
        names = domain.names
        what = (
            f"the 2-way marginal {names[i]} × {names[j]} has {big:,} cells"
            if big > limit
            else f"a spanning tree of 2-way marginals may hold {tree:,} cells"
        )
        raise DataError(
            "domain",
            f"{domain.cells:.3g} cells",
            f"{what}, over the model limit of {limit:,} cells; it cannot be measured and modelled",
            "use fewer --bins, merge levels or mark wide columns type = 'ignored' in the schema, "
            "or raise --max-cells",
        )


def read_codes(settings: SynthSettings, schema: Any, domain: Domain) -> np.ndarray:
    """The table as integer codes over ``domain`` (through the schema's encoder: per-row, public)."""
    return read_weighted_codes(settings, schema, domain)[0]


def read_weighted_codes(
    settings: SynthSettings, schema: Any, domain: Domain
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """``(codes, row weights, N)``: with a privacy unit, each unit's rows weighted ``1/n_u`` and N the
    number of units (:mod:`veil.synth.units`); else no weights and N the number of rows."""
    from veil.tables import load_table
    from veil.tables.encoder import EncodedTable

    encoded = load_table(
        settings.dataset,
        schema,
        table=settings.table,
        query=settings.query,
        with_target=schema.target is not None,
        unit_column=settings.privacy_unit,
    )
    assert isinstance(encoded, EncodedTable)
    if encoded.x.shape[0] >= 2**30:
        raise DataError(
            "dataset",
            encoded.x.shape[0],
            "tables above 2^30 rows exceed the selection's float margin",
            "sample the table first",
        )
    codes = codes_from_features(encoded.x, encoded.y, encoded.feature_names, schema, domain)
    if encoded.units is None:
        return codes, None, codes.shape[0]
    from veil.synth.units import unit_weights

    kept, weights, units = unit_weights(encoded.units)
    return codes[kept], weights, units


def check_noise_scale(settings: SynthSettings, domain: Domain, rho: float) -> None:
    """Refuse, before a row is read, a first-round noise the sampler cannot draw: the 1-way marginals'
    std (from ε, δ and the domain's size, all public) past the range of the secure lattice sampler.
    Whether that noise also swamps the counts needs N, which is private: :func:`checks_on_n`."""
    from veil.synth.measure import std_for

    sigma1 = _first_sigma(settings, len(domain), rho)
    try:
        for size in set(domain.sizes):
            std_for(sigma1, size, settings.secure_rng)
    except InvalidParameterError:
        raise InvalidParameterError(
            "epsilon",
            settings.epsilon,
            f"the 1-way marginals would need noise of std {sigma1:.3g} per count, beyond what the "
            "secure sampler can draw, so not even one column's distribution could be measured",
            "raise --epsilon (or --delta)",
        ) from None


def checks_on_n(delta: float, sigma1: float, n: int) -> list[str]:
    """What the exact record count N (rows, or units) says about the run: δ against 1/N and the 1-way
    marginals' noise std against N, as notes for the report's internal ``non_private`` section.

    Synth treats N as private (the model's row count N̂ comes from the noisy marginals), so once the
    rows are read nothing may depend on N but the accounted mechanism: these checks never refuse,
    never print, and never reach ``release/`` (a refusal at N = 1000 and none at N = 999 would reveal
    one record). Both conditions leave the (ε, δ) guarantee intact: a δ ≥ 1/N is a weak guarantee, and
    a noise above N a useless table, not a privacy failure. N = 0 (an empty table, or one emptied by
    per-record drops) flows through like any other N: no δ note (no 1/N), the noise note.
    """
    from veil.pipeline.data import delta_note

    notes = [note for note in [delta_note(delta, n)] if note is not None]
    if sigma1 >= n:
        notes.append(
            f"the 1-way marginals got noise of std {sigma1:.3g} per count, above the table's {n} "
            "records: the synthetic table carries little of the data's distribution; raise --epsilon"
        )
    return notes


def _first_sigma(settings: SynthSettings, d: int, rho: float) -> float:
    if settings.mechanism == "mst":
        return math.sqrt((3 if d > 1 else 1) * d / (2 * rho))
    return math.sqrt(16 * d / (2 * 0.9 * rho))


def run_synth(settings: SynthSettings) -> dict[str, Any]:
    """Run ``veil synth``; returns the report (also written to ``out/report.json``).

    The run is charged to its dataset's privacy budget through :class:`_Account` (see step 2 above)."""
    account = _Account()
    try:
        return _run(settings, account)
    finally:
        account.close()


class _Account:
    """The run's charge to the budget registry, on the pipeline's private-data path
    (:mod:`veil.pipeline.private_data`): the whole zCDP budget ρ reserved as one
    :class:`~veil.accounting.events.ZeroConcentrated` event before a row is read (refused: nothing
    written, nothing charged), settled to the ledger's events (MST's and AIM's measurements and
    selections, chosen as they go, their ρ summing to at most the reserved ρ, so their RDP curve lies
    below α·ρ). Once a row was read the reservation stands: a run that fails afterwards is settled at
    its plan, never released."""

    def __init__(self) -> None:
        self.account: Any = None
        self.run_id = ""
        self.ledger: Any = None

    def reserve(self, settings: SynthSettings, rho: float) -> None:
        import uuid

        from veil.accounting.events import ZeroConcentrated
        from veil.pipeline.private_data import data_ref, open_account

        self.account = open_account(data_ref(settings.dataset, settings), job="synth")
        self.run_id = uuid.uuid4().hex
        self.account.reserve([ZeroConcentrated(rho)], self.run_id, settings.delta)

    def reading(self) -> None:
        self.account.reading()

    def header(self) -> dict[str, str]:
        return {"budget_run_id": self.run_id, "budget_dataset_id": self.account.dataset_id}

    def close(self) -> None:
        if self.account is None:
            return
        self.account.finish(None if self.ledger is None else self.ledger.events())


def _run(settings: SynthSettings, account: _Account) -> dict[str, Any]:
    from veil.accounting.ledger import Ledger
    from veil.accounting.zcdp import rho_for_epsilon
    from veil.data import check_names
    from veil.mechanisms.rng import make_source
    from veil.pipeline.run_folder import LEDGER, check_out, default_out
    from veil.tables.schema import load_schema

    start = time.perf_counter()
    schema = load_schema(settings.schema)
    schema.require_reviewed(settings.schema)
    domain = domain_from_schema(schema, settings.bins)
    check_domain(domain, settings)
    out = Path(settings.out) if settings.out is not None else default_out(settings.dataset, "synth")
    check_out(out)
    rho = rho_for_epsilon(settings.epsilon, settings.delta)
    check_noise_scale(settings, domain, rho)  # public: ε, δ and the domain only
    # the header against the schema (no row): a column typo is refused for free
    check_names(
        settings.dataset,
        schema=schema,
        need_target=schema.target is not None,
        unit_column=settings.privacy_unit,
    )
    account.reserve(settings, rho)  # the budget registry: refused here, before a row is read
    account.reading()  # from here the reservation stands, whatever happens
    codes, weights, n = read_weighted_codes(settings, schema, domain)  # n: rows, or units
    notes = checks_on_n(settings.delta, _first_sigma(settings, len(domain), rho), n)  # internal only
    rng = make_source(settings.secure_rng, settings.seed)

    out.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.create(
        out / LEDGER,
        {
            "job": "synth",
            "mechanism": settings.mechanism,
            "epsilon": settings.epsilon,
            "delta": settings.delta,
            "rho": rho,
            "accountant": "rdp",
            "neighbouring": "add_or_remove_one" if weights is None else "add_or_remove_one_unit",
            "privacy_unit": settings.privacy_unit,
            **account.header(),
        },
    )
    account.ledger = ledger
    try:
        fit = _fit(settings, codes, domain, rho, rng, ledger, weights)
        report = _finish(settings, schema, domain, codes, fit, rho, rng, ledger, out, start, notes)
    finally:
        ledger.close()
    return report


def _fit(
    settings: SynthSettings,
    codes: np.ndarray,
    domain: Domain,
    rho: float,
    rng: Any,
    ledger: Any,
    weights: np.ndarray | None = None,
) -> Any:
    from veil.synth.mechanisms import aim, mst, workload_cliques

    def charge(label: str, event: Any) -> None:
        ledger.append("event", label=label, event=event.to_dict())

    progress = (lambda msg: print(f"veil synth: {msg}", flush=True)) if settings.progress else None
    if settings.mechanism == "mst":
        return mst(
            codes, domain.sizes, rho, rng, domain.names, rows=settings.rows,
            iterations=settings.iterations, progress=progress, on_event=charge, weights=weights,
        )  # fmt: skip
    return aim(
        codes, domain.sizes, rho, rng, domain.names, rows=settings.rows,
        workload=workload_cliques(len(domain), settings.degree), max_cells=settings.max_cells,
        iterations=settings.iterations, progress=progress, on_event=charge, weights=weights,
    )  # fmt: skip


def _finish(
    settings: SynthSettings,
    schema: Any,
    domain: Domain,
    codes: np.ndarray,
    fit: Any,
    rho: float,
    rng: Any,
    ledger: Any,
    out: Path,
    start: float,
    notes: list[str],
) -> dict[str, Any]:
    from veil.accounting.rdp import RDPAccountant
    from veil.pipeline.run_folder import write_files
    from veil.report.publish import publish
    from veil.synth.outputs import build_report, render_report, table_files

    accountant = RDPAccountant()
    for event in ledger.events():
        accountant.compose(event)
    spent = accountant.epsilon(settings.delta)
    if spent > settings.epsilon * (1 + 1e-9):  # pragma: no cover - the plan keeps ρ below budget
        raise InvalidParameterError(
            "epsilon", spent, "the composed events exceed the target; nothing is released", "report this bug"
        )
    fit_seconds = time.perf_counter() - start
    files = table_files(fit.codes, domain, schema, rng)
    report = build_report(settings, domain, codes, fit, rho, spent, fit_seconds, out, list(files), notes)
    write_files(out, {**files, "report.json": _json(report), "report.html": render_report(report)})
    ledger.append("end", epsilon=spent, files=sorted([*files, "report.json", "report.html"]))
    publish(out, report, files)
    return report


def _json(report: dict[str, Any]) -> str:
    import json

    from veil.pipeline.outputs import finite

    return json.dumps(finite(report), indent=1, ensure_ascii=False) + "\n"
