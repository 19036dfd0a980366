"""A dataset's privacy unit in the registry: recorded once, and every run must protect that unit.

Why the registry. The unit of privacy is a property of the data (a hospital's table protects
patients), not of one command's flags: runs that protect different things cannot be composed into
one budget (a row-level ε says nothing about a person with twelve rows, short of group privacy).
So a dataset's unit is recorded (``veil budget set --privacy-unit COLUMN``, or by the first run that
names one on a dataset without runs, in the transaction that reserves it: a run refused before its
reservation records nothing) and checked by :class:`~veil.registry.charge.DatasetCharge` before any
job reads a row:

* on a dataset with a recorded unit, a run that protects another unit, or single rows, is
  **refused** (veil does not charge it through group privacy: that bound grows with the number of
  rows a person has, which nobody declared);
* on a dataset whose recorded runs protect rows, a unit-level run is refused (the two spends do not
  compose); so is recording a unit there.

Only the column's name is stored, never an id.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from veil.errors import ConfigError
from veil.registry.database import Database, now
from veil.registry.identity import DatasetIdentity, dataset_key
from veil.registry.schema import runs, units

__all__ = ["check_unit", "claim_unit", "record_unit", "unit_of"]


def unit_of(db: Database, dataset: DatasetIdentity | str) -> str | None:
    """The dataset's recorded unit column, or None (each row is its own unit)."""
    dataset_id, _ = dataset_key(dataset)
    with db.reading() as conn:
        return _unit(conn, dataset_id)


def _unit(conn: Connection, dataset_id: str) -> str | None:
    found = conn.execute(select(units.c.privacy_unit).where(units.c.dataset_id == dataset_id)).first()
    return None if found is None else str(found[0])


def record_unit(db: Database, dataset: DatasetIdentity | str, column: str) -> None:
    """Record ``column`` as the dataset's unit (idempotent); refused where runs already protect rows
    or the dataset has another unit."""
    check_column_name(column)
    dataset_id, label = dataset_key(dataset)
    with db.locked(dataset_id, label) as (conn, row):
        claim_unit(conn, dataset_id, row.label, column)


def check_column_name(column: object) -> None:
    """Refuse a unit that is not a column name (empty, or longer than the registry keeps)."""
    if not isinstance(column, str) or not column.strip() or len(column) > 255:
        raise ConfigError("privacy_unit", column, "a unit is named by its column", "pass the column's name")


def claim_unit(conn: Connection, dataset_id: str, label: str, requested: str | None) -> None:
    """Within a transaction holding the dataset: refuse a unit other than its recorded one, and record
    ``requested`` on a dataset without a unit or runs (refused if runs already protect rows).

    A job calls it in its reservation's transaction, so a run refused before it reserves leaves
    nothing recorded (and a refused reservation rolls the unit back with the rest)."""
    recorded = _unit(conn, dataset_id)
    if recorded == requested:
        return
    if recorded is not None:
        raise _other_unit(label, recorded, requested)
    assert requested is not None
    if conn.execute(select(runs.c.run_id).where(runs.c.dataset_id == dataset_id)).first() is not None:
        raise _rows_recorded(label, requested)
    conn.execute(units.insert().values(dataset_id=dataset_id, privacy_unit=requested, created_at=now()))


def check_unit(db: Database, dataset: DatasetIdentity | str, requested: str | None) -> None:
    """Refuse, before reading, a run whose unit is not the dataset's, or a unit-level run where runs
    already protect rows. Records nothing: the unit is recorded with the run's reservation
    (:func:`claim_unit`, called by :func:`veil.registry.transactions.reserve`)."""
    dataset_id, label = dataset_key(dataset)
    with db.reading() as conn:
        recorded = _unit(conn, dataset_id)
        has_runs = conn.execute(select(runs.c.run_id).where(runs.c.dataset_id == dataset_id)).first()
    if recorded == requested:
        return
    if recorded is not None:
        raise _other_unit(label, recorded, requested)
    if has_runs is not None:
        raise _rows_recorded(label, requested)


def _rows_recorded(label: str, requested: str | None) -> ConfigError:
    return ConfigError(
        "privacy_unit",
        requested,
        f"runs already recorded on '{label}' protect single rows, and their spend cannot be "
        "composed with runs that protect people",
        "a dataset that already has row-level runs stays row-level (run without --privacy-unit); "
        "start a unit-level budget only for data never charged",
    )


def _other_unit(label: str, recorded: str, requested: str | None) -> ConfigError:
    if requested is None:
        return ConfigError(
            "privacy_unit",
            None,
            f"the registry records '{label}' as protecting each person (unit column `{recorded}`); a "
            "row-level run would protect single rows only, and is refused before reading a row",
            f"add --privacy-unit {recorded} (a job that cannot protect units cannot use this dataset)",
        )
    return ConfigError(
        "privacy_unit",
        requested,
        f"the registry records '{label}' as protecting the unit column `{recorded}`; runs protecting "
        "another unit cannot share its budget",
        f"use --privacy-unit {recorded}",
    )
