"""The registry's writes, each one transaction that holds the dataset: set, reserve, reopen, commit, release.

Guarantee. For a dataset with a budget (ε_B, δ_B), the events of every run admitted here (committed
runs with what their ledger recorded, unfinished or crashed runs with what they planned), composed by
the dataset's accountant (:mod:`veil.registry.compose`) under its neighbouring relation, give
ε ≤ ε_B at δ_B, *provided* every run on the dataset goes through :func:`reserve` before it releases
anything and releases no more than it reserved (its actual events are dominated by its plan in each
accountant that bounds the plan). :func:`reserve` reads the charged runs, composes and records in one
transaction holding the dataset (:meth:`veil.registry.database.Database.locked`), so processes
racing for the last of a budget cannot both pass. A refused reservation writes nothing.

A crashed run's reservation stays charged with its planned events: the registry cannot know how much
of it ran, so it assumes all of it. A resumed run is continued by one copy of its folder at a time,
never from a ledger older than the one it was settled with (:mod:`veil.registry.resume_lease`).
:func:`commit` replaces the plan by the events the run's ledger holds; :func:`release` un-charges a
run and is only for a run that never read a row.

:func:`commit` holds each run to its reservation: events that cost more than the plan in any
accountant the dataset uses (PLD and/or RDP, at the budget's δ) are refused as a commit and recorded
loudly: the run's status becomes ``overrun``, charged with what it released (the truth, so the
dataset's spend shows over its budget rather than hiding the excess), and a
:class:`~veil.errors.RegistryError` names the run and both ε. An overrun run is never reopened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from veil.accounting.base import check_delta, check_epsilon
from veil.accounting.events import Neighbouring, PrivacyEvent
from veil.errors import BudgetExhaustedError, InvalidParameterError, RegistryError
from veil.registry.compose import check_accountant, check_events, events_to_json, overruns, spent_epsilon
from veil.registry.database import Database, now
from veil.registry.identity import DatasetIdentity, dataset_key
from veil.registry.reporting import CHARGED, COMMITTED, OVERRUN, RELEASED, RESERVED, stored_events
from veil.registry.resume_lease import ResumeLease
from veil.registry.schema import datasets, resumes, runs

__all__ = [
    "check_lease",
    "check_run_id",
    "commit",
    "dataset_key",
    "grant_lease",
    "release",
    "reopen",
    "reserve",
    "run_row",
    "set_budget",
]


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id.strip() or len(run_id) > 255:
        raise InvalidParameterError(
            "run_id", run_id, "each run's spend is recorded under its id", "pass a non-empty id (≤ 255 chars)"
        )
    return run_id


def _charged_events(
    conn: Connection, dataset_id: str, leave_out: str | None = None
) -> list[list[PrivacyEvent]]:
    query = select(runs.c.status, runs.c.planned_events, runs.c.events).where(
        runs.c.dataset_id == dataset_id, runs.c.status.in_(CHARGED)
    )
    if leave_out is not None:
        query = query.where(runs.c.run_id != leave_out)
    return [stored_events(r) for r in conn.execute(query).all()]


def run_row(db: Database, run_id: str) -> Any:
    """A run's row, or a :class:`~veil.errors.RegistryError` if the registry has no such run."""
    with db.reading() as conn:
        row = conn.execute(select(runs).where(runs.c.run_id == check_run_id(run_id))).one_or_none()
    if row is None:
        raise RegistryError(
            "run_id", run_id, "the registry has no such run", "reserve the run before committing it"
        )
    return row


def set_budget(
    db: Database,
    dataset: DatasetIdentity | str,
    epsilon: float,
    delta: float,
    accountant: str | None = None,
    neighbouring: Neighbouring | str | None = None,
    *,
    fingerprint: str | None = None,
    privacy_unit: str | None = None,
) -> str:
    """Set (or change) a dataset's total budget; runs already recorded stay charged. Returns its id.

    ``fingerprint``: record that file for the named dataset first (:func:`veil.registry.fingerprints.link`,
    its runs move under the name); ``privacy_unit``: record the dataset's unit
    (:func:`veil.registry.units.claim_unit`). All in one transaction: a refusal of any part (the file
    is another name's, a unit on a dataset whose runs protect rows, ...) writes nothing."""
    from veil.registry.fingerprints import link
    from veil.registry.units import check_column_name, claim_unit

    dataset_id, label = dataset_key(dataset)
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if accountant is not None:
        check_accountant(accountant)
    if privacy_unit is not None:
        check_column_name(privacy_unit)
    relation = Neighbouring(neighbouring) if neighbouring is not None else None
    with db.locked(dataset_id, label) as (conn, row):
        if fingerprint is not None:
            link(conn, dataset_id, row.label, fingerprint, Neighbouring(row.neighbouring))
        if privacy_unit is not None:
            claim_unit(conn, dataset_id, row.label, privacy_unit)
        acc_name = accountant or row.accountant
        rel = relation or Neighbouring(row.neighbouring)
        recorded = _charged_events(conn, dataset_id)
        if recorded and rel.value != row.neighbouring:
            raise InvalidParameterError(
                "neighbouring",
                rel.value,
                f"runs already recorded on this dataset were accounted under {row.neighbouring}, and "
                "guarantees under different relations cannot be composed",
                f"keep --neighbouring {row.neighbouring}",
            )
        check_events([e for r in recorded for e in r], acc_name, rel)
        conn.execute(
            datasets.update()
            .where(datasets.c.dataset_id == dataset_id)
            .values(
                epsilon=epsilon,
                delta=delta,
                accountant=acc_name,
                neighbouring=rel.value,
                updated_at=now(),
                **({"label": label[:1000]} if isinstance(dataset, DatasetIdentity) else {}),
            )
        )
    return dataset_id


def reserve(
    db: Database,
    dataset: DatasetIdentity | str,
    events: Sequence[PrivacyEvent],
    run_id: str,
    *,
    job: str = "train",
    delta: float | None = None,
    neighbouring: Neighbouring | str = Neighbouring.ADD_OR_REMOVE_ONE,
    fingerprint: str | None = None,
    privacy_unit: str | None = None,
) -> str:
    """Admit a run that plans to release ``events`` on ``dataset``, or refuse it, atomically.

    Raises :class:`~veil.errors.BudgetExhaustedError` (nothing recorded) when the composed ε of all
    charged runs plus these events exceeds the dataset's budget. Returns the id of the dataset charged:
    a file's fingerprint recorded for a named dataset is charged to the name, and a named run records
    ``fingerprint`` (the content identity of the file it reads) in the same transaction
    (:mod:`veil.registry.fingerprints`). ``privacy_unit``: checked against the dataset's unit, and
    recorded as its unit by a first unit-level run, in the same transaction.
    """
    from veil.registry.fingerprints import is_fingerprint

    dataset_id, label = dataset_key(dataset)
    run_id = check_run_id(run_id)
    relation = Neighbouring(neighbouring)
    if delta is not None:
        delta = check_delta(delta)
    if is_fingerprint(dataset_id):
        fingerprint = dataset_id
    plan = _Plan(events, run_id, job, delta, relation, fingerprint, privacy_unit)
    for _ in range(2):  # a file named by a concurrent run between the look-up and the lock: once more
        with db.reading() as conn:
            target = _named(conn, dataset_id, fingerprint)
        if target is not None:
            dataset_id, label = target, target
        try:
            _admit(db, dataset_id, label, plan)
        except _NamedMeanwhile:
            continue
        return dataset_id
    raise AssertionError("unreachable: a fingerprint's name is permanent once recorded")  # pragma: no cover


@dataclass(frozen=True)
class _Plan:
    events: Sequence[PrivacyEvent]
    run_id: str
    job: str
    delta: float | None
    relation: Neighbouring
    fingerprint: str | None
    privacy_unit: str | None


class _NamedMeanwhile(Exception):
    """The fingerprint a run is charged to was recorded for a name after the look-up (rolls back)."""


class _Refused(Exception):
    """Over budget (rolls back the transaction's writes); the message is composed after the lock."""

    def __init__(self, row: Any, total: float, recorded: list[list[PrivacyEvent]]) -> None:
        self.row, self.total, self.recorded = row, total, recorded


def _named(conn: Connection, dataset_id: str, fingerprint: str | None) -> str | None:
    from veil.registry.fingerprints import name_of

    return name_of(conn, dataset_id) if fingerprint == dataset_id else None


def _admit(db: Database, dataset_id: str, label: str, plan: _Plan) -> None:
    from veil.registry.fingerprints import link
    from veil.registry.units import claim_unit

    relation = plan.relation
    try:
        with db.locked(dataset_id, label) as (conn, row):
            if _named(conn, dataset_id, plan.fingerprint) is not None:
                raise _NamedMeanwhile
            if conn.execute(select(runs.c.run_id).where(runs.c.run_id == plan.run_id)).first() is not None:
                raise RegistryError(
                    "run_id",
                    plan.run_id,
                    "this run is already recorded; recording it twice would misstate its spend",
                    "resume the run under its own id, or give a new run a new id",
                )
            claim_unit(conn, dataset_id, row.label, plan.privacy_unit)
            accountant = row.accountant
            first = conn.execute(select(runs.c.run_id).where(runs.c.dataset_id == dataset_id)).first() is None
            if plan.fingerprint is not None and plan.fingerprint != dataset_id:
                link(conn, dataset_id, row.label, plan.fingerprint, relation)  # the file's runs join
            if first and row.epsilon is None and relation.value != row.neighbouring:
                # A dataset without budget or runs takes the relation of its first run.
                conn.execute(
                    datasets.update()
                    .where(datasets.c.dataset_id == dataset_id)
                    .values(neighbouring=relation.value)
                )
            elif relation.value != row.neighbouring:
                raise InvalidParameterError(
                    "neighbouring",
                    relation.value,
                    f"this dataset's budget and runs are accounted under {row.neighbouring}, and "
                    "guarantees under different relations cannot be composed",
                    f"run under {row.neighbouring}",
                )
            recorded = _charged_events(conn, dataset_id)
            planned = check_events(plan.events, accountant, relation, [e for r in recorded for e in r])
            if row.epsilon is not None:
                total = spent_epsilon([*recorded, planned], row.delta, accountant, relation)
                if total > row.epsilon:
                    raise _Refused(row, total, recorded)
            conn.execute(
                runs.insert().values(
                    run_id=plan.run_id,
                    dataset_id=dataset_id,
                    job=plan.job[:32],
                    status=RESERVED,
                    planned_events=events_to_json(planned),
                    events=None,
                    delta=plan.delta,
                    created_at=now(),
                    finished_at=None,
                )
            )
    except _Refused as refused:  # the message is composed after the lock is released
        row, total = refused.row, refused.total
        before = spent_epsilon(refused.recorded, row.delta, row.accountant, relation)
        raise BudgetExhaustedError(
            "dataset",
            row.label,
            f"this {plan.job} run would bring the dataset's composed spend from ε = {before:.4g} to "
            f"ε = {total:.4g} at δ = {row.delta:.3g}, over its budget ε = {row.epsilon:.4g}; "
            "nothing was released or recorded",
            "plan a smaller spend (a lower --epsilon, fewer epochs), or ask the data owner to "
            "raise the budget (veil budget set); see veil budget show",
        ) from None


def reopen(
    db: Database, run_id: str, events: Sequence[PrivacyEvent], lease: ResumeLease | None = None
) -> str:
    """Re-admit a recorded run that continues (a resume) with ``events`` as its whole plan.

    The run goes back to *reserved*, charged with ``events`` (which must include what it already
    released), after the same atomic check as :func:`reserve` with the run's old record left out.
    Raises :class:`~veil.errors.BudgetExhaustedError` (nothing changed) if that would exceed the budget.
    ``lease``: the run folder's claim (:mod:`veil.registry.resume_lease`), checked and advanced in the
    same transaction; a folder another continuation overtook, or whose ledger is older than the one
    the run was settled with, is refused with a :class:`~veil.errors.RegistryError` (nothing changed).
    """
    record = run_row(db, run_id)
    if record.status == OVERRUN:
        raise RegistryError(
            "run_id",
            run_id,
            "this run released more than it reserved (overrun); continuing it under a new plan could "
            "hide what it released",
            "start a new run",
        )
    with db.locked(record.dataset_id) as (conn, row):
        accountant = row.accountant
        relation = Neighbouring(row.neighbouring)
        others = _charged_events(conn, record.dataset_id, leave_out=run_id)
        planned = check_events(events, accountant, relation, [e for r in others for e in r])
        total = None
        if row.epsilon is not None:
            total = spent_epsilon([*others, planned], row.delta, accountant, relation)
        if total is None or total <= row.epsilon:
            if lease is not None:
                _advance_lease(conn, run_id, lease)
            conn.execute(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(
                    status=RESERVED, planned_events=events_to_json(planned), events=None, finished_at=None
                )
            )
    if total is not None and total > row.epsilon:
        raise BudgetExhaustedError(
            "dataset",
            row.label,
            f"continuing run {run_id} would bring the dataset's composed spend to ε = {total:.4g} at "
            f"δ = {row.delta:.3g}, over its budget ε = {row.epsilon:.4g}; nothing was changed",
            "see veil budget show; only the data owner can raise the budget (veil budget set)",
        )
    return str(record.dataset_id)


def check_lease(db: Database, run_id: str, lease: ResumeLease) -> None:
    """The folder's claim against the run's record, read-only: what :func:`reopen` will refuse, told
    before the job reads a private row (the job calls this first; ``reopen`` checks again atomically)."""
    with db.reading() as conn:
        stored = conn.execute(select(resumes).where(resumes.c.run_id == run_id)).one_or_none()
    _refuse_claim(run_id, stored, lease)


def _advance_lease(conn: Connection, run_id: str, lease: ResumeLease) -> None:
    """Within the reopen's transaction: check the folder's claim against the run's record, then hand
    the run to this continuation (generation + 1). Raises before anything is written."""
    stored = conn.execute(select(resumes).where(resumes.c.run_id == run_id)).one_or_none()
    _refuse_claim(run_id, stored, lease)
    generation = 0 if stored is None else stored.generation
    values = {"generation": generation + 1, "ledger_records": lease.ledger_records, "updated_at": now()}
    if stored is None:
        conn.execute(resumes.insert().values(run_id=run_id, **values))
    else:
        conn.execute(resumes.update().where(resumes.c.run_id == run_id).values(**values))


def _refuse_claim(run_id: str, stored: Any, lease: ResumeLease) -> None:
    """Raise when ``lease`` is not the run's current continuation or its ledger is older."""
    generation, records = (0, 0) if stored is None else (stored.generation, stored.ledger_records)
    if lease.generation != generation:
        raise RegistryError(
            "resume",
            run_id,
            "another copy of this run folder resumed the run after this folder last held it, so "
            "continuing here would train the same data again for one charge; nothing was charged",
            "continue the folder that resumed it last, or start a new run",
        )
    if lease.ledger_records < records:
        raise RegistryError(
            "resume",
            run_id,
            f"this folder's ledger ({lease.ledger_records} records) is older than the one the run was "
            f"settled with ({records}): it is an earlier copy, and continuing it would train again "
            "what was already charged; nothing was charged",
            "continue the run's own folder, or start a new run",
        )


def grant_lease(db: Database, run_id: str, lease: ResumeLease) -> None:
    """Hand a run reserved anew for a resume (the registry had no record of it) to the folder that
    resumed it: generation ``lease.generation + 1``."""
    record = run_row(db, run_id)
    with db.locked(record.dataset_id) as (conn, _row):
        conn.execute(resumes.delete().where(resumes.c.run_id == run_id))
        conn.execute(
            resumes.insert().values(
                run_id=run_id,
                generation=lease.generation + 1,
                ledger_records=lease.ledger_records,
                updated_at=now(),
            )
        )


def _note_ledger(conn: Connection, run_id: str, ledger_records: int) -> None:
    """Within a commit's transaction: the run's ledger length as settled (never lowered)."""
    stored = conn.execute(select(resumes).where(resumes.c.run_id == run_id)).one_or_none()
    if stored is None:
        conn.execute(
            resumes.insert().values(
                run_id=run_id, generation=0, ledger_records=ledger_records, updated_at=now()
            )
        )
    elif ledger_records > stored.ledger_records:
        conn.execute(
            resumes.update()
            .where(resumes.c.run_id == run_id)
            .values(ledger_records=ledger_records, updated_at=now())
        )


def commit(
    db: Database, run_id: str, events: Sequence[PrivacyEvent], ledger_records: int | None = None
) -> str:
    """Record what a run actually released (its ledger's events) in place of its plan.

    Events beyond the plan (see the module doc) are still charged, under status ``overrun``, and
    then refused with a :class:`~veil.errors.RegistryError`: the excess is never silent.
    ``ledger_records``: a resumable run's ledger length, kept so that an older copy of its folder is
    never resumed (:mod:`veil.registry.resume_lease`).
    """
    record = run_row(db, run_id)
    with db.locked(record.dataset_id) as (conn, row):
        current = conn.execute(select(runs).where(runs.c.run_id == run_id)).one()
        if current.status != RESERVED:
            raise RegistryError(
                "run_id",
                run_id,
                f"the run is {current.status}, so its spend is already settled",
                "commit a run once, after it ends",
            )
        relation = Neighbouring(row.neighbouring)
        others = _charged_events(conn, record.dataset_id, leave_out=run_id)
        actual = check_events(events, row.accountant, relation, [e for r in others for e in r])
        delta = row.delta if row.delta is not None else (current.delta or _UNBUDGETED_DELTA)
        excess = overruns(stored_events(current), actual, delta, row.accountant, relation)
        conn.execute(
            runs.update()
            .where(runs.c.run_id == run_id)
            .values(status=OVERRUN if excess else COMMITTED, events=events_to_json(actual), finished_at=now())
        )
        if ledger_records is not None:
            _note_ledger(conn, run_id, ledger_records)
    if excess:
        name, planned, released = excess[0]
        raise RegistryError(
            "run",
            run_id,
            f"it released more than it reserved: ε = {released:.4g} against its plan's ε = {planned:.4g} "
            f"({name}, at δ = {delta:.3g}); it is recorded as 'overrun', charged with what it released, "
            "so the dataset's spend shows it",
            "find why the job ran past its plan (see veil budget show); a job must reserve its whole "
            "plan before it releases anything",
        )
    return str(record.dataset_id)


_UNBUDGETED_DELTA = 1e-6
"""The δ at which a run's released and planned ε are compared when neither the dataset's budget nor
the run states one."""


def release(db: Database, run_id: str) -> str:
    """Un-charge a reserved run. Only for a run that never read a row of its dataset."""
    record = run_row(db, run_id)
    with db.locked(record.dataset_id) as (conn, _row):
        result = conn.execute(
            runs.update()
            .where(runs.c.run_id == run_id, runs.c.status == RESERVED)
            .values(status=RELEASED, finished_at=now())
        )
        if result.rowcount != 1:
            raise RegistryError(
                "run_id", run_id, "only a reserved run can be released", "release a run before it commits"
            )
    return str(record.dataset_id)
