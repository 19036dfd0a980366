"""The privacy-budget registry: every run's events per dataset, a budget, and atomic admission.

Guarantee. For a dataset with a budget (ε_B, δ_B), the events of every run the registry admitted
(committed runs with what their ledger recorded, unfinished or crashed runs with what they planned),
composed by the dataset's accountant under its neighbouring relation, give ε ≤ ε_B at δ_B, *provided*
every run on the dataset goes through :meth:`BudgetRegistry.reserve` before it reads a row and spends
no more than it reserved. :meth:`~BudgetRegistry.reserve` checks and records in one transaction that
holds the dataset exclusively, so processes racing for the last of a budget cannot both pass:

* SQLite: every transaction starts with ``BEGIN IMMEDIATE`` (the database's write lock is taken before
  the first read, so the read-check-insert sequence is serialised across processes);
* PostgreSQL: the dataset's row is locked with ``SELECT ... FOR UPDATE`` before the runs are read
  (rows are created with ``INSERT ... ON CONFLICT DO NOTHING`` first, so even the first two runs on a
  new dataset queue on the same lock).

A refused reservation writes nothing. A crashed run's reservation stays charged with its planned
events: the registry cannot know how much of it ran, so it assumes all of it. ``commit`` replaces the
plan by the events the run's ledger holds; ``release`` un-charges a run and is only for a run that
never read a row (refused by a check before loading data).

What is stored: dataset identities and labels, run ids, job names, statuses, events, δ values and
timestamps; no row, statistic or file content of any dataset.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from veil.accounting.base import ACCOUNTANTS, AccountantName, check_delta, check_epsilon, make_accountant
from veil.accounting.events import Neighbouring, PrivacyEvent, event_from_dict
from veil.errors import BudgetExhaustedError, InvalidParameterError, RegistryError
from veil.registry.compose import compact, events_from_json, events_to_json, spent_epsilon
from veil.registry.identity import DatasetIdentity
from veil.registry.location import resolve_url
from veil.registry.schema import datasets, metadata, runs

__all__ = ["BudgetRegistry", "DatasetStatus", "RunRecord"]

RESERVED, COMMITTED, RELEASED = "reserved", "committed", "released"
_CHARGED = (RESERVED, COMMITTED)
_SCHEMA_LOCK_KEY = 0x7665696C  # "veil": serialises table creation on a shared PostgreSQL server
_SQLITE_BUSY_TIMEOUT_S = 120.0
_PG_CONNECT_TIMEOUT_S = 10


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RunRecord:
    """One run as the registry knows it; ``epsilon`` is its own ε at the dataset's reporting δ."""

    run_id: str
    job: str
    status: str
    created_at: str
    finished_at: str | None
    delta: float | None
    events: tuple[PrivacyEvent, ...]
    epsilon: float | None

    @property
    def charged(self) -> bool:
        return self.status in _CHARGED

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
            "events": [e.to_dict() for e in self.events],
        }


@dataclass(frozen=True)
class DatasetStatus:
    """A dataset's budget, composed spend and run history.

    ``delta`` is the δ the spend is stated at: the budget's δ_B, or without a budget the sum of the
    charged runs' own δ (what composing their separate guarantees would give); ``None`` if unknown.
    ``remaining_epsilon`` is ε_B − spent: headroom, not a promise that a run of that ε fits, since a new
    run is admitted by composing its events with all others (usually a run of ε ≤ headroom fits).
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset_id": self.dataset_id,
            "label": self.label,
            "epsilon_budget": self.epsilon_budget,
            "delta_budget": self.delta_budget,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "delta": self.delta,
            "spent_epsilon": self.spent_epsilon,
            "remaining_epsilon": self.remaining_epsilon,
            "over_budget": self.over_budget,
            "runs": [r.to_dict() for r in self.runs],
        }


def _dataset_key(dataset: DatasetIdentity | str) -> tuple[str, str]:
    if isinstance(dataset, DatasetIdentity):
        return dataset.id, dataset.label
    if not isinstance(dataset, str) or not dataset.strip() or len(dataset) > 255:
        raise InvalidParameterError(
            "dataset_id",
            dataset,
            "the budget is kept per dataset identity",
            "pass a DatasetIdentity or a non-empty id of at most 255 characters",
        )
    return dataset, dataset


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id.strip() or len(run_id) > 255:
        raise InvalidParameterError(
            "run_id", run_id, "each run's spend is recorded under its id", "pass a non-empty id (≤ 255 chars)"
        )
    return run_id


def _check_events(
    events: Sequence[PrivacyEvent], accountant: AccountantName, neighbouring: Neighbouring
) -> list[PrivacyEvent]:
    merged = compact(events)
    acc = make_accountant(accountant, neighbouring)
    for e in merged:
        event_from_dict(e.to_dict())  # a stored event must read back
        acc.compose(e)  # raises UnsupportedEventError naming the event; this accountant is thrown away
    return merged


class BudgetRegistry:
    """A connection to the registry database (see the module doc); use as a context manager."""

    def __init__(self, url: str | os.PathLike[str] | None = None) -> None:
        self.url = resolve_url(url)
        self.shown_url = self._redacted(self.url)
        self.engine = self._make_engine(self.url)
        with self._errors():
            self._ensure_schema()
        # Import the accountants now, so that no transaction holds a dataset's lock during an import.
        import veil.accounting.pld
        import veil.accounting.rdp  # noqa: F401

    # -- connection ------------------------------------------------------------------------------
    @staticmethod
    def _redacted(url: str) -> str:
        try:
            return make_url(url).render_as_string(hide_password=True)
        except sa_exc.ArgumentError:
            return "<unparsable URL>"

    def _make_engine(self, url: str) -> Engine:
        try:
            parsed = make_url(url)
        except sa_exc.ArgumentError:
            raise RegistryError(
                "budget registry",
                self.shown_url,
                "the database URL cannot be parsed, so no run's spend can be checked or recorded",
                "set VEIL_BUDGET_DB (or --db) to a file path, sqlite:///PATH or postgresql://USER@HOST/DB",
            ) from None
        backend = parsed.get_backend_name()
        if backend == "sqlite":
            return self._sqlite_engine(parsed.set(drivername="sqlite"))
        if backend == "postgresql":
            if parsed.drivername == "postgresql":
                parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3, the tables extra
            return self._wrap_create(
                parsed, connect_args={"connect_timeout": _PG_CONNECT_TIMEOUT_S}, poolclass=NullPool
            )
        raise RegistryError(
            "budget registry",
            self.shown_url,
            f"the registry supports SQLite and PostgreSQL, not {backend}",
            "use a sqlite:/// or postgresql:// URL",
        )

    def _wrap_create(self, url: Any, **kwargs: Any) -> Engine:
        try:
            return create_engine(url, **kwargs)
        except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ModuleNotFoundError) as exc:
            raise RegistryError(
                "budget registry",
                self.shown_url,
                f"no database driver for this URL ({exc})",
                "pip install 'veil[tables]'",
            ) from None

    def _sqlite_engine(self, url: Any) -> Engine:
        if url.database and url.database != ":memory:":
            path = Path(url.database)
            if not path.parent.is_dir():
                try:
                    path.parent.mkdir(parents=True, mode=0o700)
                except OSError as exc:
                    raise RegistryError(
                        "budget registry",
                        str(path),
                        f"its folder cannot be created ({exc.strerror})",
                        "set VEIL_BUDGET_DB to a writable path",
                    ) from None
        engine = self._wrap_create(url, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_S}, poolclass=NullPool)

        # pysqlite's own transaction handling starts transactions lazily (deferred) and would let two
        # processes read the same spend before either writes; veil emits BEGIN IMMEDIATE itself instead.
        @event.listens_for(engine, "connect")
        def _no_driver_transactions(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.ProgrammingError) as exc:
            detail = " ".join(str(getattr(exc, "orig", exc) or exc).split())[:300]
            raise RegistryError(
                "budget registry",
                self.shown_url,
                f"the database refused or could not be reached ({detail}); without it no run's spend "
                "can be checked or recorded",
                "check the URL, the server and the credentials (VEIL_BUDGET_DB or --db)",
            ) from None

    def _ensure_schema(self) -> None:
        with self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
            metadata.create_all(conn)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> BudgetRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, dataset_id: str, label: str | None = None) -> Iterator[tuple[Connection, Any]]:
        """A transaction holding ``dataset_id`` exclusively; creates its row if ``label`` is given."""
        with self._errors(), self.engine.begin() as conn:
            if label is not None:
                conn.execute(self._insert_ignore(conn, dataset_id, label))
            row = conn.execute(
                select(datasets).where(datasets.c.dataset_id == dataset_id).with_for_update()
            ).one_or_none()
            yield conn, row

    @staticmethod
    def _insert_ignore(conn: Connection, dataset_id: str, label: str) -> Any:
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        now = _now()
        return (
            insert(datasets)
            .values(
                dataset_id=dataset_id,
                label=label[:1000],
                epsilon=None,
                delta=None,
                accountant="pld",
                neighbouring=Neighbouring.ADD_OR_REMOVE_ONE.value,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=["dataset_id"])
        )

    @staticmethod
    def _charged_events(conn: Connection, dataset_id: str) -> list[list[PrivacyEvent]]:
        rows = conn.execute(
            select(runs.c.status, runs.c.planned_events, runs.c.events).where(
                runs.c.dataset_id == dataset_id, runs.c.status.in_(_CHARGED)
            )
        ).all()
        return [events_from_json(r.events if r.status == COMMITTED else r.planned_events) for r in rows]

    # -- writing ---------------------------------------------------------------------------------
    def set_budget(
        self,
        dataset: DatasetIdentity | str,
        epsilon: float,
        delta: float,
        accountant: AccountantName | None = None,
        neighbouring: Neighbouring | str | None = None,
    ) -> DatasetStatus:
        """Set (or change) a dataset's total budget; runs already recorded stay charged."""
        dataset_id, label = _dataset_key(dataset)
        epsilon = check_epsilon(epsilon)
        delta = check_delta(delta)
        if accountant is not None and accountant not in ACCOUNTANTS:
            raise InvalidParameterError(
                "accountant", accountant, "only known accountants give a checked bound", f"use {ACCOUNTANTS}"
            )
        relation = Neighbouring(neighbouring) if neighbouring is not None else None
        with self._locked(dataset_id, label) as (conn, row):
            acc_name = accountant or row.accountant
            rel = relation or Neighbouring(row.neighbouring)
            recorded = self._charged_events(conn, dataset_id)
            if recorded and rel.value != row.neighbouring:
                raise InvalidParameterError(
                    "neighbouring",
                    rel.value,
                    f"runs already recorded on this dataset were accounted under {row.neighbouring}, and "
                    "guarantees under different relations cannot be composed",
                    f"keep --neighbouring {row.neighbouring}",
                )
            _check_events([e for r in recorded for e in r], acc_name, rel)
            conn.execute(
                datasets.update()
                .where(datasets.c.dataset_id == dataset_id)
                .values(
                    epsilon=epsilon,
                    delta=delta,
                    accountant=acc_name,
                    neighbouring=rel.value,
                    updated_at=_now(),
                    **({"label": label[:1000]} if isinstance(dataset, DatasetIdentity) else {}),
                )
            )
        return self.status(dataset_id)

    def reserve(
        self,
        dataset: DatasetIdentity | str,
        events: Sequence[PrivacyEvent],
        run_id: str,
        *,
        job: str = "train",
        delta: float | None = None,
        neighbouring: Neighbouring | str = Neighbouring.ADD_OR_REMOVE_ONE,
    ) -> DatasetStatus:
        """Admit a run that plans to release ``events`` on ``dataset``, or refuse it, atomically.

        Raises :class:`~veil.errors.BudgetExhaustedError` (nothing recorded) when the composed ε of all
        charged runs plus these events exceeds the dataset's budget. Call it before reading a row.
        """
        dataset_id, label = _dataset_key(dataset)
        run_id = _check_run_id(run_id)
        relation = Neighbouring(neighbouring)
        if delta is not None:
            delta = check_delta(delta)
        with self._locked(dataset_id, label) as (conn, row):
            if conn.execute(select(runs.c.run_id).where(runs.c.run_id == run_id)).first() is not None:
                raise RegistryError(
                    "run_id",
                    run_id,
                    "this run is already recorded; recording it twice would misstate its spend",
                    "resume the run under its own id, or give a new run a new id",
                )
            accountant: AccountantName = row.accountant
            first = conn.execute(select(runs.c.run_id).where(runs.c.dataset_id == dataset_id)).first() is None
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
                    f"this dataset's budget and runs are accounted under {row.neighbouring}, and guarantees "
                    "under different relations cannot be composed",
                    f"run under {row.neighbouring}",
                )
            planned = _check_events(events, accountant, relation)
            refused: tuple[Any, list[list[PrivacyEvent]], float] | None = None
            if row.epsilon is not None:
                recorded = self._charged_events(conn, dataset_id)
                total = spent_epsilon([*recorded, planned], row.delta, accountant, relation)
                if total > row.epsilon:
                    refused = (row, recorded, total)
            if refused is None:
                conn.execute(
                    runs.insert().values(
                        run_id=run_id,
                        dataset_id=dataset_id,
                        job=job[:32],
                        status=RESERVED,
                        planned_events=events_to_json(planned),
                        events=None,
                        delta=delta,
                        created_at=_now(),
                        finished_at=None,
                    )
                )
        if refused is not None:  # the message is composed after the lock is released
            row, recorded, total = refused
            before = spent_epsilon(recorded, row.delta, accountant, relation)
            raise BudgetExhaustedError(
                "dataset",
                row.label,
                f"this run would bring the dataset's composed spend from ε = {before:.4g} to "
                f"ε = {total:.4g} at δ = {row.delta:.3g}, over its budget ε = {row.epsilon:.4g}; "
                "nothing was read or recorded",
                "plan a smaller spend (a lower --epsilon, fewer epochs), or ask the data owner to "
                "raise the budget (veil budget set); see veil budget show",
            )
        return self.status(dataset_id, per_run=False)

    def reopen(self, run_id: str, events: Sequence[PrivacyEvent]) -> DatasetStatus:
        """Re-admit a recorded run that continues (a resume) with ``events`` as its whole plan.

        The run goes back to *reserved*, charged with ``events`` (which must include what it already
        released), after the same atomic check as :meth:`reserve` with the run's old record left out.
        Raises :class:`~veil.errors.BudgetExhaustedError` (nothing changed) if that would exceed the budget.
        """
        record = self._run_row(run_id)
        with self._locked(record.dataset_id) as (conn, row):
            accountant: AccountantName = row.accountant
            relation = Neighbouring(row.neighbouring)
            planned = _check_events(events, accountant, relation)
            others = [
                events_from_json(r.events if r.status == COMMITTED else r.planned_events)
                for r in conn.execute(
                    select(runs.c.status, runs.c.planned_events, runs.c.events).where(
                        runs.c.dataset_id == record.dataset_id,
                        runs.c.status.in_(_CHARGED),
                        runs.c.run_id != run_id,
                    )
                ).all()
            ]
            total = None
            if row.epsilon is not None:
                total = spent_epsilon([*others, planned], row.delta, accountant, relation)
            if total is None or total <= row.epsilon:
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
        return self.status(record.dataset_id, per_run=False)

    def commit(self, run_id: str, events: Sequence[PrivacyEvent]) -> DatasetStatus:
        """Record what a run actually released (its ledger's events) in place of its plan."""
        record = self._run_row(run_id)
        with self._locked(record.dataset_id) as (conn, row):
            current = conn.execute(select(runs).where(runs.c.run_id == run_id)).one()
            if current.status != RESERVED:
                raise RegistryError(
                    "run_id",
                    run_id,
                    f"the run is {current.status}, so its spend is already settled",
                    "commit a run once, after it ends",
                )
            actual = _check_events(events, row.accountant, Neighbouring(row.neighbouring))
            conn.execute(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(status=COMMITTED, events=events_to_json(actual), finished_at=_now())
            )
        return self.status(record.dataset_id, per_run=False)

    def release(self, run_id: str) -> DatasetStatus:
        """Un-charge a reserved run. Only for a run that never read a row of its dataset."""
        record = self._run_row(run_id)
        with self._locked(record.dataset_id) as (conn, _row):
            result = conn.execute(
                runs.update()
                .where(runs.c.run_id == run_id, runs.c.status == RESERVED)
                .values(status=RELEASED, finished_at=_now())
            )
            if result.rowcount != 1:
                raise RegistryError(
                    "run_id", run_id, "only a reserved run can be released", "release a run before it commits"
                )
        return self.status(record.dataset_id, per_run=False)

    # -- reading ---------------------------------------------------------------------------------
    def _run_row(self, run_id: str) -> Any:
        with self._errors(), self.engine.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.run_id == _check_run_id(run_id))).one_or_none()
        if row is None:
            raise RegistryError(
                "run_id", run_id, "the registry has no such run", "reserve the run before committing it"
            )
        return row

    def run(self, run_id: str) -> RunRecord | None:
        """The registry's record of one run, or None."""
        with self._errors(), self.engine.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.run_id == _check_run_id(run_id))).one_or_none()
        return None if row is None else _run_record(row, None, "pld", Neighbouring.ADD_OR_REMOVE_ONE)

    def dataset_ids(self) -> list[str]:
        with self._errors(), self.engine.connect() as conn:
            return list(conn.execute(select(datasets.c.dataset_id).order_by(datasets.c.created_at)).scalars())

    def status(self, dataset: DatasetIdentity | str, per_run: bool = True) -> DatasetStatus:
        """Budget, composed spend and history of one dataset (an empty record if it is unknown).

        ``per_run=False`` skips each run's own ε (``RunRecord.epsilon`` is then None): one composition
        instead of one per run.
        """
        dataset_id, label = _dataset_key(dataset)
        with self._errors(), self.engine.connect() as conn:
            row = conn.execute(select(datasets).where(datasets.c.dataset_id == dataset_id)).one_or_none()
            run_rows = conn.execute(
                select(runs).where(runs.c.dataset_id == dataset_id).order_by(runs.c.created_at, runs.c.run_id)
            ).all()
        if row is None:
            return DatasetStatus(
                dataset_id, label, None, None, "pld", Neighbouring.ADD_OR_REMOVE_ONE.value, None, 0.0, ()
            )
        relation = Neighbouring(row.neighbouring)
        charged = [r for r in run_rows if r.status in _CHARGED]
        if row.delta is not None:
            delta: float | None = row.delta
        else:
            deltas = [r.delta for r in charged if r.delta is not None]
            delta = min(sum(deltas), 1.0) if deltas else None
        records = tuple(
            _run_record(r, delta if per_run else None, row.accountant, relation) for r in run_rows
        )
        spent: float | None
        if not charged:
            spent = 0.0
        elif delta is None or delta >= 1.0:
            spent = None
        else:
            spent = spent_epsilon(
                [list(r.events) for r in records if r.charged], delta, row.accountant, relation
            )
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

    def statuses(self) -> list[DatasetStatus]:
        return [self.status(d) for d in self.dataset_ids()]


def _run_record(row: Any, delta: float | None, accountant: str, relation: Neighbouring) -> RunRecord:
    stored = row.events if row.status == COMMITTED else row.planned_events
    events = tuple(events_from_json(stored))
    eps: float | None = None
    if row.status != RELEASED and delta is not None and delta < 1.0:
        eps = spent_epsilon([list(events)], delta, accountant, relation)  # type: ignore[arg-type]
        eps = None if math.isnan(eps) else eps
    return RunRecord(
        run_id=row.run_id,
        job=row.job,
        status=row.status,
        created_at=row.created_at,
        finished_at=row.finished_at,
        delta=row.delta,
        events=events,
        epsilon=eps,
    )
