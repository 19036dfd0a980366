"""The report of a federated run, a function of its run folder (ledger, history, silos, settings).

The guarantee is recomputed from the ledger's charged events with veil's accountant, never taken
from what the run believed: client level, every charged round (``step`` and ``recovered`` records);
record level, each silo's own records (a ``recovered`` record, whose silo is unknown, is charged to
every silo) and the maximum over silos (parallel composition). Figures computed from private data
without noise — test accuracy of the global model, how many clients replied or failed — sit in the
``non_private`` section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veil.accounting.calibrate import epsilon_of
from veil.accounting.events import PrivacyEvent, event_from_dict
from veil.accounting.ledger import Ledger
from veil.federated.files import HISTORY, LEDGER, MODEL, SILOS
from veil.federated.privacy import flower_epsilon, record_level_guarantee
from veil.federated.settings import FederatedSettings
from veil.federated.units import unit_section
from veil.pipeline.checks import participation_check

__all__ = [
    "build_report",
    "epsilon_curve",
    "guarantee_text",
    "render_report",
    "silo_events",
    "write_report",
]

_CURVE_POINTS = 12


def _epsilon(events: list[PrivacyEvent], delta: float, accountant: str) -> float:
    return epsilon_of(events, delta, accountant)  # type: ignore[arg-type]


def epsilon_curve(events: list[PrivacyEvent], delta: float, accountant: str) -> list[tuple[int, float]]:
    """ε after round r for about 12 rounds spread over the run (and always the last)."""
    n = len(events)
    if n == 0:
        return []
    stride = max(1, n // _CURVE_POINTS)
    marks = sorted({*range(stride, n + 1, stride), n})
    return [(r, _epsilon(events[:r], delta, accountant)) for r in marks]


def silo_events(ledger: Ledger, silos: dict[str, Any]) -> dict[str, list[PrivacyEvent]]:
    """Each silo's charged events (a ``recovered`` record, whose silo is unknown, goes to every silo)."""
    out: dict[str, list[PrivacyEvent]] = {name: [] for name in silos}
    for r in ledger.records:
        if r["kind"] == "step" and r.get("silo") in out:
            out[r["silo"]].append(event_from_dict(r["event"]))
        elif r["kind"] == "recovered":
            for events in out.values():
                events.append(event_from_dict(r["event"]))
    return out


def build_report(run_dir: Path, duration_s: float | None = None) -> dict[str, Any]:
    """``report.json``'s content for the run in ``run_dir``."""
    run_dir = Path(run_dir)
    ledger = Ledger.open(run_dir / LEDGER)
    s = FederatedSettings.from_run_config(ledger.header["settings"])
    history = json.loads((run_dir / HISTORY).read_text())["rounds"] if (run_dir / HISTORY).exists() else []
    finished = ledger.last("end") is not None
    guarantee: dict[str, Any] = {
        "mode": s.mode,
        "target_epsilon": s.epsilon,
        "delta": s.delta,
        "accountant": s.accountant,
    }
    plan: dict[str, Any] = {"clients": s.clients, "rounds_planned": s.rounds, "partition": s.partition}
    part = (
        _client_level(s, ledger)
        if s.mode == "client-level"
        else _record_level(s, ledger, run_dir, history[-1] if history else {})
    )
    guarantee |= part.guarantee
    plan |= part.plan
    checks = [
        *part.checks,
        {
            "name": "rounds",
            "passed": guarantee["rounds_charged"] <= s.rounds,
            "detail": f"{guarantee['rounds_charged']} of {s.rounds} planned rounds charged",
        },
    ]
    randomness = (
        "secure (OS CSPRNG)" if s.secure else f"seeded (research mode, seed {s.seed}): not releasable"
    )
    report = {
        "job": "federated",
        "guarantee": guarantee,
        "plan": plan,
        "dataset": s.dataset,
        "model": s.model,
        "randomness": randomness,
        "release_ready": s.secure and finished and all(c["passed"] for c in checks),
        "finished": finished,
        "checks": checks,
        "non_private": _non_private(history),
        "plots": part.plots,
        "files": {
            LEDGER: "the privacy ledger (hash-chained, fsync'ed before each round)",
            MODEL: "the released global model (the head's arrays; the front is fixed by a public seed)",
            HISTORY: "per-round non-private evaluation",
        },
        "duration_s": duration_s,
        "out_dir": str(run_dir),
    }
    if part.privacy_unit is not None:
        report["privacy_unit"] = part.privacy_unit
    return report


@dataclass
class _ModePart:
    """What one mode adds to the report: guarantee and plan fields, checks, plots, the unit section."""

    guarantee: dict[str, Any]
    plan: dict[str, Any]
    checks: list[dict[str, Any]]
    plots: dict[str, Any] = field(default_factory=dict)
    privacy_unit: dict[str, Any] | None = None


def _non_private(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures computed from data without noise (evaluation), outside the guarantee."""
    last = history[-1] if history else {}
    keep = ("round", "test_accuracy", "test_loss", "replied", "failed")
    return {
        "note": "computed from data without noise: for evaluation, not covered by the guarantee",
        "final_test_accuracy": last.get("test_accuracy"),
        "per_round": [{k: v for k, v in h.items() if k in keep} for h in history],
    }


def _client_level(s: FederatedSettings, ledger: Ledger) -> _ModePart:
    """DP-FedAvg: ε over every charged round, add/remove one client."""
    events = ledger.events()
    eps = _epsilon(events, s.delta, s.accountant)
    guarantee: dict[str, Any] = {
        "neighbouring": "add_or_remove_one_client",
        "epsilon_spent": eps,
        "rounds_charged": ledger.steps,
        "unit": "client: everything one client holds",
    }
    plan = {
        "client_sampling": "poisson",
        "sampling_rate": s.sampling_rate,
        "expected_clients_per_round": s.expected_clients,
        "noise_multiplier": s.sigma,
        "update_clip_norm": s.clip,
        "noise_std_on_sum": s.sigma * s.clip,
        "server_lr": s.server_lr,
        "local_epochs": s.local_epochs,
        "local_lr": s.local_lr,
        "local_batch": s.local_batch,
    }
    if s.sampling_rate == 1.0 and ledger.steps:
        guarantee["flower_rdp_epsilon"] = flower_epsilon(s.sigma, ledger.steps, s.clients, s.delta)
        guarantee["flower_rdp_note"] = (
            "Flower's own RDP accountant (flwr.serverapp.RdpAccountant, no amplification) on the "
            "same rounds, side by side: it covers this case only (every client each round, fixed C)"
        )
    checks = [
        {
            "name": "budget",
            "passed": eps <= s.epsilon * (1 + 1e-9),
            "detail": f"ε = {eps:.4f} ≤ target {s.epsilon:g} over {ledger.steps} charged rounds",
        }
    ]
    counts = [int(r["sampled"]) for r in ledger.of_kind("step") if "sampled" in r]
    if counts and s.sampling_rate < 1.0:
        checks.append(participation_check(counts, s.clients, s.sampling_rate).model_dump())
    checks.append(
        {
            "name": "delta",
            "passed": s.delta < 1.0 / s.clients,
            "detail": f"δ = {s.delta:g} < 1/N = {1.0 / s.clients:g} (N clients)",
        }
    )
    plots = {"epsilon_per_round": epsilon_curve(events, s.delta, s.accountant)}
    return _ModePart(guarantee, plan, checks, plots)


def _record_level(s: FederatedSettings, ledger: Ledger, run_dir: Path, last: dict[str, Any]) -> _ModePart:
    """DP-SGD in each silo: each silo's ε from its own ledger records, the largest over silos
    (parallel composition); with a privacy unit, the record is a unit (a person) of one silo."""
    silos = json.loads((run_dir / SILOS).read_text()) if (run_dir / SILOS).exists() else {}
    per_silo = silo_events(ledger, silos)
    spend = {
        name: {
            **info,
            "epsilon": _epsilon(per_silo[name], s.delta, s.accountant),
            "steps": sum(getattr(e, "count", 1) for e in per_silo[name]),
        }
        for name, info in silos.items()
    }
    top = record_level_guarantee(spend)
    unit = unit_section(s, silos)
    guarantee = {
        "neighbouring": "add_or_remove_one_record" if unit is None else "add_or_remove_one_unit",
        "epsilon_spent": top["epsilon"],
        "composition": top["composition"],
        "worst_silo": top.get("worst_silo"),
        "rounds_charged": len({r.get("round") for r in ledger.records if r["kind"] == "step"}),
        "unit": "record: one row of one silo"
        if unit is None
        else f"person: every row with one value of `{unit['column']}`, all in one silo",
        "silos": spend,
    }
    plan = {
        "local_steps": s.local_steps,
        "record_clip_norm": s.clip,
        "local_batch": s.local_batch,
        "local_lr": s.local_lr,
    }
    checks = _record_level_checks(s, spend, top["epsilon"], last)
    return _ModePart(guarantee, plan, checks, privacy_unit=unit)


def _record_level_checks(
    s: FederatedSettings, spend: dict[str, dict[str, Any]], epsilon: float, last: dict[str, Any]
) -> list[dict[str, Any]]:
    """Budget, the silos' own accounts against the ledger's, and δ below 1/n of every silo (n its
    records: units with a privacy unit)."""
    reported = {
        f"silo-{int(m['partition-id'])}": float(m["epsilon"]) for m in last.get("silos", []) if "epsilon" in m
    }
    agree = all(
        abs(reported[k] - spend[k]["epsilon"]) <= 1e-6 * max(1.0, spend[k]["epsilon"]) for k in reported
    )
    what = "units" if s.privacy_unit else "rows"
    return [
        {
            "name": "budget",
            "passed": epsilon <= s.epsilon * (1 + 1e-9),
            "detail": f"max over silos ε = {epsilon:.4f} ≤ target {s.epsilon:g}",
        },
        {
            "name": "silo accounts agree",
            "passed": agree,
            "detail": "each silo's own accountant reports the ε the server's ledger composes"
            if reported
            else "no silo reply in the last round to compare",
        },
        {
            "name": "delta",
            "passed": all(
                s.delta < 1.0 / n
                for n in (v["units"] if "units" in v else v["rows"] for v in spend.values())
                if n
            ),
            "detail": f"δ = {s.delta:g} below 1/n of every silo (n its {what})",
        },
    ]


def guarantee_text(report: dict[str, Any]) -> str:
    """The guarantee in one sentence, for the report page."""
    g = report["guarantee"]
    if g["mode"] == "client-level":
        return (
            f"The released global model satisfies ({g['epsilon_spent']:.3g}, {g['delta']:g})-differential "
            "privacy at the client level: whether any one client took part (with all of its data) changes "
            f"the probability of any outcome by at most a factor e^{g['epsilon_spent']:.3g}, except with "
            f"probability {g['delta']:g}. Accounted with veil's {g['accountant']} accountant over "
            f"{g['rounds_charged']} Poisson-sampled rounds; the server is trusted to clip and add the noise."
        )
    if g.get("neighbouring") == "add_or_remove_one_unit":
        return (
            f"The released global model satisfies ({g['epsilon_spent']:.3g}, {g['delta']:g})-differential "
            f"privacy for each person ({g['unit']}), whatever number of rows they have: adding or removing "
            "one person with all their rows. Every row of a person lies in one silo (a keyed hash of the "
            "unit); each silo trained with unit-level DP-SGD on its own people (at most K rows of a person "
            "per step, the mean of their gradients clipped once); by parallel composition the guarantee "
            f"is the largest silo's ε ({g.get('worst_silo', 'none')}); every silo's spend is listed below."
        )
    return (
        f"The released global model satisfies ({g['epsilon_spent']:.3g}, {g['delta']:g})-differential "
        "privacy at the record level: adding or removing one record of one silo. Each silo trained with "
        "DP-SGD on its own data; the silos' data are disjoint, so by parallel composition the guarantee "
        f"is the largest silo's ε ({g.get('worst_silo', 'none')}); every silo's spend is listed below. A "
        "person with several rows is protected only by group privacy, which is weaker (name a "
        "--privacy-unit column to protect people)."
    )


def _plots(report: dict[str, Any]) -> dict[str, bytes]:
    from veil.report.plots import epsilon_png, figure, png_bytes

    images: dict[str, bytes] = {}
    g = report["guarantee"]
    curve = report["plots"].get("epsilon_per_round")
    if curve:
        images["ε spent against the round (client level)"] = epsilon_png(
            [tuple(p) for p in curve], g["target_epsilon"], g["rounds_charged"], g["delta"]
        )
    rows = [h for h in report["non_private"]["per_round"] if h.get("test_accuracy") is not None]
    if rows:
        plt, fig = figure(6.0, 3.6)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([h["round"] for h in rows], [h["test_accuracy"] for h in rows], marker=".")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.set_title("Global model's test accuracy per round (non-private figure)")
        images["Test accuracy per round (non-private figure)"] = png_bytes(plt, fig)
    return images


def render_report(report: dict[str, Any]) -> str:
    """``report.html``: the federated page of veil's one report stack."""
    from veil.report.render import render_page

    return render_page(
        "federated.html.j2",
        _plots(report),
        r=report,
        g=report["guarantee"],
        guarantee=guarantee_text(report),
        checks=report["checks"],
        files=report["files"],
        summary=report.get("summary", ""),
        dataset_budget=report.get("dataset_budget"),
    )


def write_report(run_dir: Path, duration_s: float | None = None) -> dict[str, Any]:
    """Build the report from the run folder and write ``report.json`` and ``report.html`` atomically,
    then ``release/`` (the global model and the public report) and the folder sealed owner-only."""
    from veil.pipeline.outputs import finite
    from veil.pipeline.run_folder import write_files
    from veil.report.publish import publish

    report = envelope(Path(run_dir), finite(build_report(run_dir, duration_s)))
    write_files(
        Path(run_dir),
        {
            "report.json": json.dumps(report, indent=2, allow_nan=False) + "\n",
            "report.html": render_report(report),
        },
    )
    model = Path(run_dir) / MODEL
    publish(Path(run_dir), report, {MODEL: model.read_bytes()} if model.is_file() else {})
    return dict(report)


def envelope(run_dir: Path, old: dict[str, Any]) -> dict[str, Any]:
    """The report in the common schema (:mod:`veil.report.schema`): the former ``guarantee`` object's
    fields stay in the new one; the rest is the ``federated`` section."""
    from veil.registry.charge import budget_section_for
    from veil.report.publish import plain_summary
    from veil.report.schema import Evidence, Guarantee, ReportBuilder

    ledger = Ledger.open(run_dir / LEDGER)
    events = ledger.events()
    g = dict(old.pop("guarantee"))
    client = g["mode"] == "client-level"
    guarantee = Guarantee(
        epsilon=g["epsilon_spent"],
        delta=g["delta"],
        unit="client" if client else "record of one silo" if "privacy_unit" not in old else "privacy unit",
        neighbouring=g["neighbouring"],
        accountant=g["accountant"],
        covers=f"the released global model ({MODEL}); not the per-round evaluation (non_private)",
        randomness="secure" if str(old["randomness"]).startswith("secure") else "seeded",
        release_ready=bool(old["release_ready"]),
        statement=guarantee_text({"guarantee": g}),
        evidence=Evidence.of(LEDGER, events) if events else None,
        extra=g,
    )
    b = ReportBuilder("federated", guarantee)
    non_private = old.pop("non_private")
    checks = old.pop("checks")
    old.pop("files")
    b.public_fields(old)
    b.non_private_fields({**non_private, "test_accuracy": non_private.get("final_test_accuracy")})
    b.file(LEDGER, "the privacy ledger (hash-chained, fsync'ed before each round)")
    b.file(
        MODEL,
        "the released global model (the head's arrays; the front is fixed by a public seed)",
        release=True,
    )
    b.file(HISTORY, "per-round evaluation of the global model on test rows", non_private=True)
    b.file("report.json", "this report, machine-readable (the full internal one)")
    b.file("report.html", "this report (the full internal one)")
    b.file("release", "what the guarantee covers, publishable as is: the global model and the public report")
    b.release_file("report.json").release_file("report.html").checks(checks)
    header = ledger.header
    b.dataset_budget = budget_section_for(
        header.get("budget_run_id"), None, run_dir, dataset_id=header.get("budget_dataset_id")
    )
    b.summary = plain_summary(guarantee.to_dict(), b.dataset_budget, "the global model")
    return b.build()
