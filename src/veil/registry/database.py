"""Reaching the registry's database: the engine for a URL, one-line errors, the tables, the dataset lock.

Which database is :mod:`veil.registry.location`'s job; this module connects to it and provides the one
primitive every write needs, :meth:`Database.locked`: a transaction that holds one dataset exclusively,
so that a read-compose-check-insert sequence of two processes cannot interleave:

* SQLite: every transaction starts with ``BEGIN IMMEDIATE`` (the database's write lock is taken before
  the first read; pysqlite's own lazy transactions are switched off);
* PostgreSQL (psycopg 3): the dataset's row is inserted if missing (``INSERT ... ON CONFLICT DO
  NOTHING``), then locked with ``SELECT ... FOR UPDATE``, so even the first two runs on a new dataset
  queue on the same lock. The tables are created under an advisory lock.

Every SQLAlchemy error that means "the database refused or cannot be reached" becomes one
:class:`~veil.errors.RegistryError` line, with the password hidden.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from veil.accounting.events import Neighbouring
from veil.errors import RegistryError
from veil.registry.compose import DEFAULT_ACCOUNTANT
from veil.registry.location import resolve_url
from veil.registry.schema import datasets, metadata

__all__ = ["Database", "lock_dataset", "now"]

_SCHEMA_LOCK_KEY = 0x7665696C  # "veil": serialises table creation on a shared PostgreSQL server
_SQLITE_BUSY_TIMEOUT_S = 120.0
_PG_CONNECT_TIMEOUT_S = 10


def now() -> str:
    """A timestamp as the registry stores it: ISO 8601 UTC, to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _redacted(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return "<unparsable URL>"


class Database:
    """The registry's database: an engine, the URL to show (no password), and its transactions."""

    def __init__(self, url: str | os.PathLike[str] | None = None) -> None:
        self.url = resolve_url(url)
        self.shown_url = _redacted(self.url)
        self.engine = self._make_engine(self.url)
        with self.errors():
            self._ensure_schema()

    # -- connection ------------------------------------------------------------------------------
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
            _create_owner_only(path)
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
    def errors(self) -> Iterator[None]:
        """Turn a database failure into one :class:`~veil.errors.RegistryError` line."""
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

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """A plain connection for reads (no lock)."""
        with self.errors(), self.engine.connect() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    # -- the dataset lock ------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, dataset_id: str, label: str | None = None) -> Iterator[tuple[Connection, Any]]:
        """A transaction holding ``dataset_id`` exclusively; creates its row if ``label`` is given."""
        with self.errors(), self.engine.begin() as conn:
            yield conn, lock_dataset(conn, dataset_id, label)


def lock_dataset(conn: Connection, dataset_id: str, label: str | None = None) -> Any:
    """Within ``conn``'s transaction, hold ``dataset_id``'s row (created first if ``label`` is given)
    and return it (None: no such dataset). A transaction holding two datasets takes a name's first."""
    if label is not None:
        conn.execute(_insert_ignore(conn, dataset_id, label))
    return conn.execute(
        select(datasets).where(datasets.c.dataset_id == dataset_id).with_for_update()
    ).one_or_none()


def _create_owner_only(path: Path) -> None:
    """Create a new SQLite file as owner-only (0600) whatever the umask; an existing one is left as is
    (a team may share it on purpose). SQLite gives its journal files the database file's mode."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return
    except OSError:
        return  # the engine reports an unwritable location in its own words
    os.chmod(path, 0o600)


def _insert_ignore(conn: Connection, dataset_id: str, label: str) -> Any:
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    stamp = now()
    return (
        insert(datasets)
        .values(
            dataset_id=dataset_id,
            label=label[:1000],
            epsilon=None,
            delta=None,
            accountant=DEFAULT_ACCOUNTANT,
            neighbouring=Neighbouring.ADD_OR_REMOVE_ONE.value,
            created_at=stamp,
            updated_at=stamp,
        )
        .on_conflict_do_nothing(index_elements=["dataset_id"])
    )
