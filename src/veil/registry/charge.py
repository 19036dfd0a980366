"""How a job charges a dataset's budget: check before reading, reserve before releasing, settle at the end.

A job that spends privacy on a dataset (``veil train``, a DP schema release, ...) uses one
:class:`DatasetCharge`:

1. :meth:`DatasetCharge.before_reading` — the dataset's identity (raw bytes hashed, nothing parsed) and
   a first check: a dataset whose recorded runs already spend its whole budget admits nothing, so the
   job is refused before it reads a row. (Composition never lowers ε, so no run can fit then.)
2. :meth:`DatasetCharge.reserve` — the job's planned events (or a stand-in when the plan needs N, then
   :meth:`DatasetCharge.replan`), before the first private row is read and *before* anything computed
   from the data is released or written: the atomic admission of
   :func:`veil.registry.transactions.reserve`.
3. :meth:`DatasetCharge.settle` — the events the job's ledger holds, when it ends (normally or by an
   error after the first release); :meth:`DatasetCharge.release` instead when it ended before releasing
   anything. A job killed in between stays charged with its plan.

Charge before read, never un-charge after. Once a private row may have been read, whether the job
goes on can depend on that row, so un-charging then would make the recorded spend depend on the data.
:meth:`DatasetCharge.release` therefore un-charges only a reservation made with
``before_reading=True`` and before :meth:`DatasetCharge.reading` was called; in every other case
(a reservation after reading) it settles the *planned* events, at least what the job could have
released. A job whose plan needs N (``veil train``, ``veil tune``) reserves a stand-in before reading
(:func:`veil.pipeline.private_data.stand_in_plan`: its target ε at δ) and :meth:`DatasetCharge.replan`
replaces it by the plan once it is known; a job that stops in between is settled at the stand-in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.accounting.events import Neighbouring, PrivacyEvent
from veil.errors import BudgetExhaustedError, ConfigError
from veil.registry.identity import FINGERPRINT_KINDS, DatasetIdentity, content_fingerprint, dataset_identity

if TYPE_CHECKING:
    from veil.registry.store import BudgetRegistry

__all__ = ["DatasetCharge", "budget_section_for", "open_registry"]

_OPEN: dict[str, DatasetCharge] = {}
"""The charges with a reservation in this process, by run id: a report finds its run's account here."""


def open_registry(db: str | os.PathLike[str] | None = None) -> BudgetRegistry:
    """A :class:`~veil.registry.store.BudgetRegistry`, or a one-line error if SQLAlchemy is missing."""
    try:
        from veil.registry.store import BudgetRegistry
    except ModuleNotFoundError as exc:
        raise ConfigError(
            "budget registry",
            exc.name,
            "every run's spend is recorded per dataset in the budget registry, which needs SQLAlchemy; "
            "without it the run's spend could not be checked against the dataset's budget",
            "reinstall veil (SQLAlchemy is one of its dependencies): pip install veil",
        ) from None
    return BudgetRegistry(db)


class DatasetCharge:
    """One job's account with the registry for one dataset (see the module doc for the order of calls)."""

    def __init__(
        self,
        registry: BudgetRegistry,
        identity: DatasetIdentity,
        job: str,
        *,
        fingerprint: str | None = None,
        privacy_unit: str | None = None,
    ) -> None:
        self.registry = registry
        self.identity = identity
        self.job = job
        self.fingerprint = fingerprint
        """The content identity of the file the job reads (None: a source without one)."""
        self.privacy_unit = privacy_unit
        self.run_id: str | None = None
        self._planned: list[PrivacyEvent] = []
        self._rows_read = True  # until a reservation says otherwise: assume the job has read

    @classmethod
    def before_reading(
        cls,
        spec: str,
        *,
        job: str,
        data_dir: str | Path | None = None,
        table: str | None = None,
        query: str | None = None,
        dataset_id: str | None = None,
        db: str | os.PathLike[str] | None = None,
        refuse_if_spent: bool = True,
        privacy_unit: str | None = None,
    ) -> DatasetCharge:
        """Identify the dataset and refuse at once if its budget is already spent.

        ``refuse_if_spent=False`` (a resume, whose own reservation is part of the spend) only opens the
        account; :meth:`resume` then checks the run's plan with its old record left out.
        ``privacy_unit``: the unit column the job protects (None: single rows); a run whose unit is
        not the dataset's recorded one is refused here (:mod:`veil.registry.units`). A file whose
        fingerprint is recorded for a named dataset is charged to the name; under another name it is
        refused here (:mod:`veil.registry.fingerprints`).
        """
        identity = dataset_identity(spec, dataset_id=dataset_id, table=table, query=query, data_dir=data_dir)
        if identity.id.startswith(FINGERPRINT_KINDS):
            fingerprint: str | None = identity.id
        else:  # a named run records the file it reads (hashed here, before a row is read)
            fingerprint = content_fingerprint(spec, table=table, query=query, data_dir=data_dir)
        charge = cls(open_registry(db), identity, job, fingerprint=fingerprint, privacy_unit=privacy_unit)
        try:
            charge._resolve_name()
        except BaseException:
            charge.close()
            raise
        identity = charge.identity
        if not refuse_if_spent:
            return charge
        status = charge.registry.status(identity, per_run=False)
        spent, budget = status.spent_epsilon, status.epsilon_budget
        if budget is not None and spent is not None and spent >= budget:
            charge.close()
            raise BudgetExhaustedError(
                "dataset",
                identity.label,
                f"its recorded runs already spend ε = {spent:.4g} of its budget ε = {budget:.4g} at "
                f"δ = {status.delta_budget:.3g}, so no further run can fit; refused before any row was "
                "parsed (the file's bytes were only hashed to identify it): nothing was released or "
                "recorded",
                "see veil budget show; only the data owner can raise the budget (veil budget set)",
            )
        return charge

    def _resolve_name(self) -> None:
        """Charge a file recorded for a named dataset to the name; refuse a file recorded under
        another name, and a unit that is not the dataset's (:mod:`veil.registry.fingerprints`,
        :mod:`veil.registry.units`). Reads only: nothing is recorded before the reservation."""
        from veil.registry.units import check_unit

        if self.fingerprint is not None:
            recorded = self.registry.name_of(self.fingerprint)
            if self.identity.id == self.fingerprint and recorded is not None:
                self.identity = DatasetIdentity(recorded, recorded)
            elif recorded not in (None, self.identity.id):
                from veil.registry.fingerprints import refuse_other_name

                raise refuse_other_name(self.identity.label, str(recorded), self.fingerprint)
            elif recorded is None and self.identity.id != self.fingerprint:
                # The file's own runs will join the name: they must protect the run's unit too.
                check_unit(self.registry.db, self.fingerprint, self.privacy_unit)
        check_unit(self.registry.db, self.identity, self.privacy_unit)

    def reserve(
        self,
        events: Sequence[PrivacyEvent],
        run_id: str,
        delta: float,
        neighbouring: Neighbouring | str = Neighbouring.ADD_OR_REMOVE_ONE,
        *,
        before_reading: bool = False,
    ) -> None:
        """Admit the planned events or raise :class:`~veil.errors.BudgetExhaustedError` (nothing recorded).

        ``before_reading=True``: the job has not read a row yet (it must call :meth:`reading` before
        the first); only then can :meth:`release` un-charge the reservation."""
        from veil.registry import transactions  # not the registry's method: no status composed to discard

        charged = transactions.reserve(
            self.registry.db,
            self.identity,
            events,
            run_id,
            job=self.job,
            delta=delta,
            neighbouring=neighbouring,
            fingerprint=self.fingerprint,
            privacy_unit=self.privacy_unit,
        )
        if charged != self.identity.id:  # the file was named by a concurrent run meanwhile
            self.identity = DatasetIdentity(charged, charged)
        self.run_id = run_id
        self._planned = list(events)
        self._rows_read = not before_reading
        _OPEN[run_id] = self

    def reading(self) -> None:
        """The job is about to read its first private row: from now on the reservation stands."""
        self._rows_read = True

    def replan(self, events: Sequence[PrivacyEvent], delta: float) -> None:
        """Replace this run's reservation (a stand-in reserved before reading, whose ε at δ is the
        job's target) by its real plan, once the job knows it (a DP-SGD plan needs N).

        Only after :meth:`reading`: from here the run stays charged, with the real plan if the
        registry admits it, else (:class:`~veil.errors.BudgetExhaustedError`, nothing changed) with
        the stand-in, which :meth:`release` then settles. The real plan spends at most the target
        too, so the charge does not drop below what a job that stops here leaves."""
        assert self.run_id is not None, "reserve before replanning"
        self.reading()
        self.resume(self.run_id, events, delta)

    def check_resume(self, run_id: str, folder: Path, ledger_records: int) -> None:
        """Refuse, before a private row is read, a folder that :meth:`resume` would refuse (another copy
        resumed the run since, or its ledger is older than the settled one); read-only."""
        if self.registry.run(run_id) is None:
            return
        from veil.registry import resume_lease, transactions

        transactions.check_lease(self.registry.db, run_id, resume_lease.held(folder, run_id, ledger_records))

    def resume(
        self,
        run_id: str,
        events: Sequence[PrivacyEvent],
        delta: float,
        *,
        folder: Path | None = None,
        ledger_records: int = 0,
    ) -> None:
        """Continue a run with ``events`` as its whole plan (a run the registry never saw is reserved).

        ``folder``: the run folder that continues it, whose ledger holds ``ledger_records`` records:
        refused (:class:`~veil.errors.RegistryError`, nothing charged) when another copy of the folder
        resumed the run since, or when its ledger is older than the one the run was settled with;
        granted, the folder records that it holds the run (:mod:`veil.registry.resume_lease`)."""
        from veil.registry import resume_lease, transactions

        lease = None if folder is None else resume_lease.held(folder, run_id, ledger_records)
        if self.registry.run(run_id) is None:
            self.reserve(events, run_id, delta)
            if folder is not None and lease is not None:
                transactions.grant_lease(self.registry.db, run_id, lease)
                resume_lease.take(folder, run_id, lease)
            return
        transactions.reopen(self.registry.db, run_id, events, lease)
        if folder is not None and lease is not None:
            resume_lease.take(folder, run_id, lease)
        self.run_id = run_id
        self._planned = list(events)
        self._rows_read = True
        _OPEN[run_id] = self

    def budget_section(
        self, events: Sequence[PrivacyEvent] | None, report: Path | str | None
    ) -> dict[str, Any]:
        """The report's ``dataset_budget`` section, this run counted with ``events`` (what it released;
        ``None``: its plan); notes the run's user and report folder for ``veil budget report``."""
        from veil.registry.reporting import budget_section

        if self.run_id is not None:
            self.registry.note_run(self.run_id, _user(), None if report is None else str(report))
        status = self.registry.status(self.identity, per_run=False)
        released = self.registry.released_id(status.dataset_id)
        return budget_section(status, self.run_id, events, self.registry.run_notes(), released)

    def settle(self, events: Sequence[PrivacyEvent], ledger_records: int | None = None) -> None:
        """Charge what the job actually released (its ledger's events) in place of the plan;
        ``ledger_records``: a resumable run's ledger length (:mod:`veil.registry.resume_lease`)."""
        if self.run_id is not None:
            from veil.registry import transactions

            transactions.commit(self.registry.db, self.run_id, events, ledger_records)
            _OPEN.pop(self.run_id, None)
            self.run_id = None

    def release(self, ledger_records: int | None = None) -> None:
        """End a job that released nothing, or one that stopped before its plan: un-charge its
        reservation if no row was read yet, else settle the planned events (never un-charge after a
        read; see the module doc). ``ledger_records``: as for :meth:`settle`."""
        if self.run_id is None:
            return
        if self._rows_read:
            self.settle(self._planned, ledger_records)
            return
        from veil.registry import transactions

        transactions.release(self.registry.db, self.run_id)
        _OPEN.pop(self.run_id, None)
        self.run_id = None

    def finish(self, events: Sequence[PrivacyEvent] | None) -> None:
        """End the job's account: :meth:`settle` with ``events`` (what the job released), or
        :meth:`release` when it released nothing (``None``: the plan stays charged once a row may
        have been read); the registry is closed either way."""
        try:
            if events is None:
                self.release()
            else:
                self.settle(events)
        finally:
            self.close()

    def close(self) -> None:
        if self.run_id is not None:
            _OPEN.pop(self.run_id, None)
        self.registry.close()


def budget_section_for(
    run_id: str | None,
    events: Sequence[PrivacyEvent] | None,
    report: Path | str | None,
    dataset_id: str | None = None,
    db: str | os.PathLike[str] | None = None,
) -> dict[str, Any] | None:
    """The ``dataset_budget`` section of the run ``run_id``: through its open charge in this process,
    else (a run already settled, or a job that charges nothing) from the registry's record of
    ``dataset_id`` (or of the name its file is recorded for); None when neither is known."""
    charge = _OPEN.get(run_id or "")
    if charge is not None:
        return charge.budget_section(events, report)
    if not dataset_id:
        return None
    from veil.registry.reporting import budget_section

    with open_registry(db) as registry:
        dataset_id = registry.name_of(dataset_id) or dataset_id  # a file recorded for a name
        if run_id and registry.run(run_id) is not None:
            registry.note_run(run_id, _user(), None if report is None else str(report))
        status = registry.status(dataset_id, per_run=False)
        released = registry.released_id(status.dataset_id)
        return budget_section(status, run_id, events, registry.run_notes(), released)


def _user() -> str | None:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in the environment or passwd
        return None
