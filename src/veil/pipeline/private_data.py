"""The one path from a job to private rows: identify → charge → read → split.

Every job that touches private rows (``veil train``, ``tune``, ``pate``, ``synth``, ``federated``,
``schema infer --epsilon``) goes through these steps, in this order:

1. **Identify** — :class:`DataRef` holds what names the dataset (``--dataset``, ``--dataset-id``,
   ``--table``/``--query``, ``--data-dir``), built once from a job's settings by :func:`data_ref`;
   :func:`open_account` resolves it through :func:`veil.registry.identity.dataset_identity` (the one
   resolver: the same dataset read from CSV, Parquet or SQL under one ``--dataset-id`` is one budget)
   and refuses a dataset whose budget is already spent — before a row is read.
2. **Charge** — :meth:`PrivateAccount.reserve` admits the job's whole plan. From the moment a private
   row is read (:meth:`PrivateAccount.reading`) the charge never shrinks: a job that then fails is
   settled at its plan, never released (whether a job runs to the end may depend on one record).
3. **Read** — through one reader per format (:mod:`veil.tables.sources`), applying the schema's
   per-record public rules (a label outside the declared set drops the row; a bad cell is missing).
4. **Split** — :func:`record_positions` / :func:`record_mask`: a keyed hash of the record (or of its
   unit key), never of its position or of the other records.

Guarantee of the split. A record's side depends on that record (or its unit key) and the public
key alone: adding or removing one record leaves every other record where it was, so add/remove
neighbours of the data stay add/remove neighbours of every part (training, validation, teachers,
clients).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.events import Neighbouring, PrivacyEvent

if TYPE_CHECKING:
    from veil.registry.charge import DatasetCharge

__all__ = [
    "DataRef",
    "PrivateAccount",
    "data_ref",
    "open_account",
    "record_mask",
    "record_positions",
    "stand_in_plan",
]


@dataclass(frozen=True)
class DataRef:
    """What names one dataset for the budget registry (nothing is read from it)."""

    spec: str
    dataset_id: str | None = None
    table: str | None = None
    query: str | None = None
    data_dir: str | None = None
    privacy_unit: str | None = None
    """The unit column (``--privacy-unit``): the registry refuses a row-level run on a dataset
    recorded with a unit, before a row is read."""
    init_from: str | None = None
    """The weights the job starts from (``--init-from``): refused before a row is read when the
    registry records them as released by a run on this dataset
    (:func:`veil.models.pretrained.refuse_released_here`)."""


def data_ref(spec: str, settings: Mapping[str, Any] | Any) -> DataRef:
    """The :class:`DataRef` of a job's settings (a mapping or an object with those attributes);
    an empty value means none."""

    def get(name: str) -> Any:
        if isinstance(settings, Mapping):
            return settings.get(name)
        return getattr(settings, name, None)

    return DataRef(
        spec,
        dataset_id=get("dataset_id") or None,
        table=get("table") or None,
        query=get("query") or None,
        data_dir=get("data_dir") or None,
        privacy_unit=get("privacy_unit") or None,
        init_from=get("init_from") or None,
    )


class PrivateAccount:
    """A job's account with the registry for one dataset, with the rule that a read charge stands.

    Order: :func:`open_account` (identify, refuse a spent budget) → :meth:`reserve` (the plan) →
    :meth:`reading` (from here the charge never shrinks) → :meth:`finish` (what the job released)."""

    def __init__(self, charge: DatasetCharge) -> None:
        self.charge = charge
        self.closed = False

    @property
    def dataset_id(self) -> str:
        return self.charge.identity.id

    @property
    def run_id(self) -> str | None:
        return self.charge.run_id

    def released_id(self) -> str:
        """The id a released artefact names the dataset by: the registry's random id for a content
        fingerprint (never the fingerprint, a function of every private row), else the identity as it
        is (:func:`veil.registry.public_ids.released_id`)."""
        return self.charge.registry.released_id(self.dataset_id)

    def reserve(
        self,
        events: Sequence[PrivacyEvent],
        run_id: str,
        delta: float,
        neighbouring: Neighbouring | str = Neighbouring.ADD_OR_REMOVE_ONE,
    ) -> None:
        """Admit the whole plan (refused: nothing recorded), before any private row is read."""
        self.charge.reserve(events, run_id, delta, neighbouring, before_reading=True)

    def reading(self) -> None:
        """Mark that private rows are being read: from now on the reservation is never released."""
        self.charge.reading()

    def replan(self, events: Sequence[PrivacyEvent], delta: float) -> None:
        """Replace the reserved stand-in (:func:`stand_in_plan`) by the job's real plan, once read
        (:meth:`DatasetCharge.replan`)."""
        self.charge.replan(events, delta)

    def finish(self, events: Sequence[PrivacyEvent] | None) -> None:
        """Settle with ``events`` (what the job released); with ``None`` (nothing released) the
        registry releases the reservation only if no private row was read, else settles it at the
        plan (:meth:`DatasetCharge.finish`). Closes the registry."""
        self.closed = True
        self.charge.finish(None if events is None else list(events))

    def budget_section(self, events: Sequence[PrivacyEvent] | None, report: Any) -> dict[str, Any]:
        """The report's ``dataset_budget`` section (:meth:`DatasetCharge.budget_section`)."""
        return self.charge.budget_section(events, report)

    def close(self) -> None:
        """Close the registry (once; :meth:`finish` closes it too)."""
        if not self.closed:
            self.closed = True
            self.charge.close()


def stand_in_plan(epsilon: float, delta: float) -> list[PrivacyEvent]:
    """The charge of a job whose plan needs N, reserved before a row is read: one Gaussian release
    whose ε at ``delta`` is ``epsilon`` (public settings only). σ is calibrated with the PLD
    accountant, the tightest for a Gaussian: whichever accountant composes the dataset, the stand-in
    costs at least ``epsilon`` at ``delta``.

    Why a stand-in. A DP-SGD plan's events need N (the sampling rate B/N), which is known only once
    the rows are read; but a job with a target ε never spends more than that target at its δ (σ is
    calibrated to it, or training stops before a step that would pass it). So the job reserves this
    stand-in — a release of exactly (ε, δ) — before reading, and replaces it by its real plan
    (:meth:`PrivateAccount.replan`) once it knows N. A job that stops in between (a refusal that
    depends on the rows) is settled at the stand-in: reading is never free."""
    from veil.accounting.calibrate import calibrate_noise
    from veil.accounting.events import Gaussian

    sigma = calibrate_noise(epsilon, delta, 1.0, 1, "pld")
    return [Gaussian(sigma)]


def open_account(
    ref: DataRef,
    *,
    job: str,
    db: str | os.PathLike[str] | None = None,
    refuse_if_spent: bool = True,
) -> PrivateAccount:
    """Identify the dataset (the one resolver) and refuse it at once if its budget is spent, or if the
    job starts from weights released by a run on it (``--init-from``).

    Before the registry is opened, a ``sql:`` source's public refusals (a password in the URL, a
    ``--query`` whose check would run it: :func:`veil.data.check_sql_request`) are made here, for
    every job: such input never records a run nor spends ε."""
    from veil.data import check_sql_request
    from veil.registry.charge import DatasetCharge

    check_sql_request(ref.spec, query=ref.query)

    charge = DatasetCharge.before_reading(
        ref.spec,
        job=job,
        data_dir=ref.data_dir,
        table=ref.table,
        query=ref.query,
        dataset_id=ref.dataset_id,
        db=db,
        refuse_if_spent=refuse_if_spent,
        privacy_unit=ref.privacy_unit,
    )
    if ref.init_from is not None:
        from veil.models.pretrained import refuse_released_here

        try:
            refuse_released_here(ref.init_from, charge)
        except BaseException:
            charge.close()
            raise
    return PrivateAccount(charge)


def record_positions(
    x: np.ndarray,
    labels: Sequence[str],
    domain: str,
    seed: int,
    units: Sequence[object] | np.ndarray | None = None,
) -> np.ndarray:
    """Each record's position in [0, 1): a keyed BLAKE2b hash of its own features and label name,
    or of its unit key ``units[i]`` when given (every row of one unit lands together). The key comes
    from ``domain`` (one per kind of split) and the public ``seed``."""
    from veil.data import row_hashes

    if units is not None:
        keys = [repr(u.item() if hasattr(u, "item") else u) for u in units]
        hashes = row_hashes(np.zeros((len(keys), 0)), keys, domain, seed)
    else:
        hashes = row_hashes(x, list(labels), domain, seed)
    return np.array([(h >> 11) * 2.0**-53 for h in hashes], dtype=np.float64)


def record_mask(
    x: np.ndarray,
    labels: Sequence[str],
    fraction: float,
    domain: str,
    seed: int,
    units: Sequence[object] | np.ndarray | None = None,
) -> np.ndarray:
    """Which records fall in a part of share ``fraction``: those whose :func:`record_positions` is
    below it. The part's size varies like a binomial; each record's side is its own."""
    return record_positions(x, labels, domain, seed, units) < fraction
