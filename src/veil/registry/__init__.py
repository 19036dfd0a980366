"""The privacy-budget registry: one total budget per dataset, across runs, jobs and people.

Every run on a dataset records its privacy events here (the same events its ledger holds); the total
spent on a dataset is the accountant's composition of all of them, never a sum of ε; a run whose
planned events would take the composition over the dataset's budget is refused before it reads a
row. The registry is a database reached through SQLAlchemy: a SQLite file per user by default, a
PostgreSQL server for a team. See ``docs/budget.md``.

Modules: :mod:`~veil.registry.identity` (what counts as the same dataset; no database),
:mod:`~veil.registry.compose` (composition of stored events; no database),
:mod:`~veil.registry.location` (which database), :mod:`~veil.registry.store` (the database itself,
SQLAlchemy, a core dependency; PostgreSQL also needs psycopg from the ``tables`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from veil.registry.identity import DatasetIdentity, dataset_identity

if TYPE_CHECKING:
    from veil.registry.store import BudgetRegistry, DatasetStatus, RunRecord

__all__ = ["BudgetRegistry", "DatasetIdentity", "DatasetStatus", "RunRecord", "dataset_identity"]


def __getattr__(name: str) -> Any:
    if name in ("BudgetRegistry", "DatasetStatus", "RunRecord"):
        from veil.registry import store

        return getattr(store, name)
    raise AttributeError(f"module 'veil.registry' has no attribute {name!r}")
