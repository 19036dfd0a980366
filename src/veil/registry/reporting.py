"""What the registry reports: a dataset's budget, composed spend and run history.

:func:`dataset_status` turns a dataset's row and its runs' rows into a :class:`DatasetStatus`; nothing
here writes. The spend is :func:`veil.registry.compose.spent_epsilon` over the *charged* runs
(committed runs with what their ledger recorded, reserved ones with their plan), at the budget's δ,
or without a budget at the sum of the charged runs' own δ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from veil.accounting.events import Neighbouring, PrivacyEvent
from veil.registry.compose import DEFAULT_ACCOUNTANT, events_from_json, spent_epsilon
from veil.registry.identity import FINGERPRINT_KINDS

__all__ = [
    "CHARGED",
    "COMMITTED",
    "OVERRUN",
    "RELEASED",
    "RESERVED",
    "DatasetStatus",
    "RunRecord",
    "budget_section",
    "dataset_status",
    "empty_status",
    "public_label",
    "run_record",
    "stored_events",
]

RESERVED, COMMITTED, RELEASED = "reserved", "committed", "released"
OVERRUN = "overrun"
"""A run that released more than it reserved: charged with what it released, shown in the history."""
CHARGED = (RESERVED, COMMITTED, OVERRUN)
SETTLED = (COMMITTED, OVERRUN)


def stored_events(row: Any) -> list[PrivacyEvent]:
    """The events a run row is charged with: its ledger's once settled, its plan before."""
    return events_from_json(row.events if row.status in SETTLED else row.planned_events)


@dataclass(frozen=True)
class RunRecord:
    """One run as the registry knows it; ``epsilon`` is its own ε alone, stated at ``epsilon_delta``:
    the run's own δ (a valid (ε, δ) statement for that run), or the dataset's reporting δ for a run
    recorded without one."""

    run_id: str
    job: str
    status: str
    created_at: str
    finished_at: str | None
    delta: float | None
    events: tuple[PrivacyEvent, ...]
    epsilon: float | None
    epsilon_delta: float | None = None

    @property
    def charged(self) -> bool:
        return self.status in CHARGED

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "job": self.job,
            "status": self.status,
            "charged": self.charged,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "delta": self.delta,
            "epsilon": self.epsilon,
            "epsilon_delta": self.epsilon_delta,
            "events": [e.to_dict() for e in self.events],
        }


@dataclass(frozen=True)
class DatasetStatus:
    """A dataset's budget, composed spend and run history.

    ``delta`` is the δ the spend is stated at: the budget's δ_B, or without a budget the sum of the
    charged runs' own δ (what composing their separate guarantees would give); ``None`` if unknown.
    ``remaining_epsilon`` is ε_B − spent: headroom, not a promise that a run of that ε fits, since a new
    run is admitted by composing its events with all others (usually a run of ε ≤ headroom fits).
    ``jobs`` counts the charged runs per job kind (``train``, ``schema``, ``synth``, ``tune``, ...).
    """

    dataset_id: str
    label: str
    epsilon_budget: float | None
    delta_budget: float | None
    accountant: str
    neighbouring: str
    delta: float | None
    spent_epsilon: float | None
    runs: tuple[RunRecord, ...] = field(default_factory=tuple)
    privacy_unit: str | None = None
    """The unit column every run protects (:mod:`veil.registry.units`); None: single rows."""
    fingerprints: tuple[str, ...] = ()
    """The content fingerprints of the files recorded for this named dataset: a run on one of them
    without ``--dataset-id`` is charged here (:mod:`veil.registry.fingerprints`)."""

    @property
    def remaining_epsilon(self) -> float | None:
        if self.epsilon_budget is None or self.spent_epsilon is None:
            return None
        return max(self.epsilon_budget - self.spent_epsilon, 0.0)

    @property
    def over_budget(self) -> bool:
        return (
            self.epsilon_budget is not None
            and self.spent_epsilon is not None
            and self.spent_epsilon > self.epsilon_budget
        )

    @property
    def jobs(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.runs:
            if r.charged:
                counts[r.job] = counts.get(r.job, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset_id": self.dataset_id,
            "label": self.label,
            "epsilon_budget": self.epsilon_budget,
            "delta_budget": self.delta_budget,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "privacy_unit": self.privacy_unit,
            "fingerprints": list(self.fingerprints),
            "delta": self.delta,
            "spent_epsilon": self.spent_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "over_budget": self.over_budget,
            "jobs": self.jobs,
            "runs": [r.to_dict() for r in self.runs],
        }


def run_record(row: Any, delta: float | None, accountant: str, relation: Neighbouring) -> RunRecord:
    """A run row as a :class:`RunRecord`, with its own ε at its own δ (at ``delta``, the dataset's
    reporting δ, when the run has none); ``delta=None``: not computed."""
    events = tuple(stored_events(row))
    eps: float | None = None
    at = row.delta if row.delta is not None else delta
    if row.status != RELEASED and delta is not None and at is not None and at < 1.0:
        eps = spent_epsilon([list(events)], at, accountant, relation)
        eps = None if math.isnan(eps) else eps
    else:
        at = None
    return RunRecord(
        run_id=row.run_id,
        job=row.job,
        status=row.status,
        created_at=row.created_at,
        finished_at=row.finished_at,
        delta=row.delta,
        events=events,
        epsilon=eps,
        epsilon_delta=at,
    )


def empty_status(dataset_id: str, label: str) -> DatasetStatus:
    """The status of a dataset the registry has never seen."""
    relation = Neighbouring.ADD_OR_REMOVE_ONE.value
    return DatasetStatus(dataset_id, label, None, None, DEFAULT_ACCOUNTANT, relation, None, 0.0, ())


def reporting_delta(budget_delta: float | None, charged: Sequence[Any]) -> float | None:
    """The δ a dataset's total spend is stated at: its budget's, else the sum of the charged runs' own δ
    (at most 1; None when no run states one)."""
    if budget_delta is not None:
        return budget_delta
    deltas = [r.delta for r in charged if r.delta is not None]
    return min(sum(deltas), 1.0) if deltas else None


def dataset_status(row: Any, run_rows: Sequence[Any], per_run: bool = True) -> DatasetStatus:
    """Budget, composed spend and history from a dataset row and its run rows (in order).

    ``per_run=False`` skips each run's own ε (``RunRecord.epsilon`` is then None): one composition
    instead of one per run.
    """
    relation = Neighbouring(row.neighbouring)
    charged = [r for r in run_rows if r.status in CHARGED]
    delta = reporting_delta(row.delta, charged)
    records = tuple(run_record(r, delta if per_run else None, row.accountant, relation) for r in run_rows)
    spent: float | None
    if not charged:
        spent = 0.0
    elif delta is None or delta >= 1.0:
        spent = None
    else:
        spent = spent_epsilon([list(r.events) for r in records if r.charged], delta, row.accountant, relation)
    return DatasetStatus(
        dataset_id=row.dataset_id,
        label=row.label,
        epsilon_budget=row.epsilon,
        delta_budget=row.delta,
        accountant=row.accountant,
        neighbouring=row.neighbouring,
        delta=delta,
        spent_epsilon=spent,
        runs=records,
    )


def public_label(label: str, dataset_id: str, released_id: str | None) -> str | None:
    """A dataset's label as a report may show it: never a content fingerprint.

    A dataset the registry does not know (``veil audit`` on a new file) is labelled by its id, which
    for a file read without ``--dataset-id`` is the SHA-256 of its bytes: a function of every private
    row (:mod:`veil.registry.public_ids`). Such a label, or one that contains the digest, is replaced
    by ``released_id`` (the registry's random id for it; None: withheld)."""
    digest = dataset_id.split(":", 1)[-1] if dataset_id.startswith(FINGERPRINT_KINDS) else None
    if label.startswith(FINGERPRINT_KINDS) or (digest is not None and digest in label):
        return released_id
    return label


def as_found(status: DatasetStatus, run_id: str | None) -> list[RunRecord]:
    """The charged runs a report of ``run_id`` counts: those admitted up to and including it (the
    registry's order, ``created_at`` then ``run_id``); every charged run when ``run_id`` is None or
    unknown (``veil budget report``).

    Why (revJ's J6): a run admitted after ``run_id`` is in the registry when ``run_id``'s report is
    written only if ``run_id`` was still running then, so listing it, or counting it in the spend,
    would tell ``run_id``'s duration, which grows with private facts (revH's H6)."""
    charged = [r for r in status.runs if r.charged]
    ids = [r.run_id for r in charged]
    return charged if run_id not in ids else charged[: ids.index(run_id) + 1]


def budget_section(
    status: DatasetStatus,
    run_id: str | None = None,
    events: Sequence[PrivacyEvent] | None = None,
    info: Mapping[str, Mapping[str, Any]] | None = None,
    released_id: str | None = None,
) -> dict[str, Any]:
    """A report's ``dataset_budget`` section: the dataset's budget, the composed spend of its charged
    runs (``run_id`` counted with ``events``, what it released, in place of its plan) and each run's
    own ε at its own δ. ``info``: who ran each run and where its report is (``veil_budget_run_info``).
    A run's report counts the runs admitted up to it (:func:`as_found`), each with its live status;
    the public view withholds the other runs' statuses (:func:`veil.report.schema.public_view`).

    ``spent_delta`` is the δ the total is stated at (the budget's, or without a budget the sum of the
    runs' own δ); a DP preprocessing release (``veil schema infer --epsilon``) is one of the runs.

    ``released_id`` is the id ``release/`` names the dataset by
    (:func:`veil.registry.public_ids.released_id`); without it, the dataset's own id unless that is a
    content fingerprint (a function of the private rows), in which case the release withholds it.
    ``label`` is never a fingerprint where a released id is given (:func:`public_label`).

    ``unit`` / ``neighbouring`` are the dataset's as the registry records them
    (:mod:`veil.registry.units`): ``row`` / the dataset's row relation, or, on a dataset with a
    recorded privacy unit, that unit and the relation on units (``add_or_remove_one_unit``: one unit
    with all its rows), which is what every run charged there protects.
    """
    relation = Neighbouring(status.neighbouring)
    runs = as_found(status, run_id)
    own = {
        r.run_id: (list(events) if events is not None and r.run_id == run_id else list(r.events))
        for r in runs
    }
    delta = reporting_delta(status.delta_budget, runs)  # of the runs counted, not the registry's all
    spent: float | None = 0.0 if not runs else None
    if delta is not None and delta < 1.0 and runs:
        spent = spent_epsilon(list(own.values()), delta, status.accountant, relation)
    left = None
    if status.epsilon_budget is not None and spent is not None:
        left = max(status.epsilon_budget - spent, 0.0)
    info = info or {}
    rows = []
    for r in runs:
        eps = None
        if r.delta is not None and 0.0 < r.delta < 1.0:
            eps = spent_epsilon([own[r.run_id]], r.delta, status.accountant, relation)
            eps = None if math.isnan(eps) else eps
        extra = info.get(r.run_id, {})
        rows.append(
            {
                "run_id": r.run_id,
                "job": r.job,
                "epsilon": eps,
                "delta": r.delta,
                # When the run was admitted: never its end, which with the start (in this run's own
                # report) would give its duration, a function of the private rows (revH's H6).
                "at": r.created_at,
                "status": r.status,
                "this_run": r.run_id == run_id,
                "user": extra.get("user"),
                "report": extra.get("report"),
            }
        )
    if released_id is None and not status.dataset_id.startswith(FINGERPRINT_KINDS):
        released_id = status.dataset_id
    unit = status.privacy_unit
    return {
        "dataset_id": status.dataset_id,
        "released_id": released_id,
        # without a released id (no registry at hand) the internal section keeps its label, as it
        # keeps its dataset_id; the public view withholds both (veil.report.schema.public_view)
        "label": public_label(status.label, status.dataset_id, released_id) or status.label,
        "unit": "row" if unit is None else f"privacy unit ({unit})",
        "privacy_unit": unit,
        "neighbouring": status.neighbouring if unit is None else f"{status.neighbouring}_unit",
        "accountant": status.accountant,
        "budget_epsilon": status.epsilon_budget,
        "budget_delta": status.delta_budget,
        "spent_epsilon": spent,
        "spent_delta": delta,
        "left_epsilon": left,
        "runs": rows,
    }
