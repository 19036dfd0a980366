"""The privacy-budget registry: every run's events per dataset, a budget, and atomic admission.

:class:`BudgetRegistry` is the one object jobs and the CLI use; it joins three modules with one job
each: :mod:`~veil.registry.database` (connecting, the per-dataset lock), :mod:`~veil.registry.transactions`
(set, reserve, reopen, commit, release — the guarantee is stated there) and
:mod:`~veil.registry.reporting` (status and history). The composition rule is
:mod:`~veil.registry.compose`'s.

What is stored: dataset identities and labels, run ids, job names, statuses, events, δ values and
timestamps, and who ran each run and where its report is; no row, statistic or file content of any
dataset.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import delete, select

from veil.accounting.events import Neighbouring, PrivacyEvent
from veil.registry import transactions
from veil.registry.database import Database
from veil.registry.identity import DatasetIdentity, dataset_key
from veil.registry.reporting import DatasetStatus, RunRecord, dataset_status, empty_status, run_record
from veil.registry.schema import datasets, fingerprints, run_info, runs

__all__ = ["BudgetRegistry", "DatasetStatus", "RunRecord"]


class BudgetRegistry:
    """A connection to the registry database (see the module doc); use as a context manager."""

    def __init__(self, url: str | os.PathLike[str] | None = None) -> None:
        self.db = Database(url)
        self.url = self.db.url
        self.shown_url = self.db.shown_url
        self.engine = self.db.engine
        # Import the accountants now, so that no transaction holds a dataset's lock during an import.
        import veil.accounting.pld
        import veil.accounting.tuning  # noqa: F401  (the RDP side of the composition)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> BudgetRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing (veil.registry.transactions) ---------------------------------------------------
    def set_budget(
        self,
        dataset: DatasetIdentity | str,
        epsilon: float,
        delta: float,
        accountant: str | None = None,
        neighbouring: Neighbouring | str | None = None,
        *,
        fingerprint: str | None = None,
        privacy_unit: str | None = None,
    ) -> DatasetStatus:
        """Set (or change) a dataset's total budget; runs already recorded stay charged. With
        ``fingerprint`` / ``privacy_unit``, the file is recorded for the name and the unit for the
        dataset in the same transaction (:func:`veil.registry.transactions.set_budget`)."""
        dataset_id = transactions.set_budget(
            self.db,
            dataset,
            epsilon,
            delta,
            accountant,
            neighbouring,
            fingerprint=fingerprint,
            privacy_unit=privacy_unit,
        )
        return self.status(dataset_id)

    def set_unit(self, dataset: DatasetIdentity | str, column: str) -> DatasetStatus:
        """Record the dataset's privacy unit (see :mod:`veil.registry.units`)."""
        from veil.registry.units import record_unit

        record_unit(self.db, dataset, column)
        return self.status(dataset)

    def reserve(
        self,
        dataset: DatasetIdentity | str,
        events: Sequence[PrivacyEvent],
        run_id: str,
        *,
        job: str = "train",
        delta: float | None = None,
        neighbouring: Neighbouring | str = Neighbouring.ADD_OR_REMOVE_ONE,
        privacy_unit: str | None = None,
    ) -> DatasetStatus:
        """Admit a run that plans to release ``events``, or raise :class:`~veil.errors.BudgetExhaustedError`
        (nothing recorded). Call it before anything computed from the data is released.
        ``privacy_unit``: the unit the run protects (None: rows); must be the dataset's recorded one."""
        dataset_id = transactions.reserve(
            self.db,
            dataset,
            events,
            run_id,
            job=job,
            delta=delta,
            neighbouring=neighbouring,
            privacy_unit=privacy_unit,
        )
        return self.status(dataset_id, per_run=False)

    def reopen(self, run_id: str, events: Sequence[PrivacyEvent]) -> DatasetStatus:
        """Re-admit a recorded run that continues (a resume) with ``events`` as its whole plan."""
        return self.status(transactions.reopen(self.db, run_id, events), per_run=False)

    def commit(self, run_id: str, events: Sequence[PrivacyEvent]) -> DatasetStatus:
        """Record what a run actually released (its ledger's events) in place of its plan."""
        return self.status(transactions.commit(self.db, run_id, events), per_run=False)

    def release(self, run_id: str) -> DatasetStatus:
        """Un-charge a reserved run. Only for a run that never read a row of its dataset."""
        return self.status(transactions.release(self.db, run_id), per_run=False)

    # -- reading (veil.registry.reporting) ------------------------------------------------------
    def run(self, run_id: str) -> RunRecord | None:
        """The registry's record of one run, or None."""
        with self.db.reading() as conn:
            row = conn.execute(
                select(runs).where(runs.c.run_id == transactions.check_run_id(run_id))
            ).one_or_none()
        return None if row is None else run_record(row, None, "auto", Neighbouring.ADD_OR_REMOVE_ONE)

    def dataset_ids(self) -> list[str]:
        """Every dataset, less the files recorded for a name (their runs are the name's)."""
        named = select(fingerprints.c.fingerprint)
        with self.db.reading() as conn:
            query = select(datasets.c.dataset_id).where(datasets.c.dataset_id.not_in(named))
            return list(conn.execute(query.order_by(datasets.c.created_at)).scalars())

    # -- the files a named dataset was read from (veil.registry.fingerprints) -----------------------
    def name_of(self, fingerprint: str) -> str | None:
        """The named dataset a file's fingerprint is recorded for, or None."""
        from veil.registry.fingerprints import name_of

        with self.db.reading() as conn:
            return name_of(conn, fingerprint)

    def resolve(self, identity: DatasetIdentity) -> DatasetIdentity:
        """``identity``, or the named dataset its file is recorded for (which is charged instead)."""
        name = self.name_of(identity.id)
        return identity if name is None else DatasetIdentity(name, name)

    def link(self, dataset: DatasetIdentity | str, fingerprint: str) -> DatasetStatus:
        """Record a file's ``fingerprint`` for the named ``dataset`` and move the runs charged to the
        file under it (:func:`veil.registry.fingerprints.link`)."""
        from veil.registry.fingerprints import link

        dataset_id, label = dataset_key(dataset)
        with self.db.locked(dataset_id, label) as (conn, row):
            link(conn, dataset_id, row.label, fingerprint, Neighbouring(row.neighbouring))
        return self.status(dataset_id)

    def status(self, dataset: DatasetIdentity | str, per_run: bool = True) -> DatasetStatus:
        """Budget, composed spend and history of one dataset (an empty record if it is unknown).

        ``per_run=False`` skips each run's own ε (``RunRecord.epsilon`` is then None).
        """
        dataset_id, label = dataset_key(dataset)
        with self.db.reading() as conn:
            row = conn.execute(select(datasets).where(datasets.c.dataset_id == dataset_id)).one_or_none()
            run_rows = conn.execute(
                select(runs).where(runs.c.dataset_id == dataset_id).order_by(runs.c.created_at, runs.c.run_id)
            ).all()
        if row is None:
            return empty_status(dataset_id, label)
        from veil.registry.fingerprints import fingerprints_of
        from veil.registry.units import unit_of

        with self.db.reading() as conn:
            files = tuple(fingerprints_of(conn, dataset_id))
        status = dataset_status(row, run_rows, per_run)
        return replace(status, privacy_unit=unit_of(self.db, dataset_id), fingerprints=files)

    def released_id(self, dataset_id: str) -> str:
        """The id a release names ``dataset_id`` by: a random one for a content fingerprint
        (:func:`veil.registry.public_ids.released_id`)."""
        from veil.registry.public_ids import released_id

        return released_id(self.db, dataset_id)

    def statuses(self) -> list[DatasetStatus]:
        return [self.status(d) for d in self.dataset_ids()]

    # -- who ran a run and where its report is (``veil budget report``) -------------------------------
    def note_run(self, run_id: str, user: str | None, report: str | None) -> None:
        """Record ``run_id``'s user and report folder (replacing an earlier note)."""
        with self.db.errors(), self.engine.begin() as conn:
            conn.execute(delete(run_info).where(run_info.c.run_id == run_id))
            conn.execute(run_info.insert().values(run_id=run_id, user=user, report=report))

    def run_notes(self) -> dict[str, dict[str, Any]]:
        """Every noted run: run id → ``{"user", "report"}``."""
        with self.db.reading() as conn:
            rows = conn.execute(select(run_info)).all()
        return {r.run_id: {"user": r.user, "report": r.report} for r in rows}
