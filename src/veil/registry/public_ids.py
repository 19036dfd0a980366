"""The id a release names a dataset by: never a function of the private rows.

Why. A file read without ``--dataset-id`` is identified in the registry by the SHA-256 of its bytes
(:mod:`veil.registry.identity`). That fingerprint is a deterministic function of every row, computed
without noise: two neighbouring files have different fingerprints, and anyone who knows all rows but
one recovers the missing one by hashing candidates. It is the operator's key (the registry and the
internal report keep it); ``release/`` must not carry it.

What a release shows instead (:func:`released_id`):

* a content fingerprint (``sha256:``/``dir-sha256:``): ``dataset-<32 hex>``, random
  (:func:`secrets.token_hex`), drawn once per fingerprint and stored in ``veil_budget_public_ids``, so
  every release on the same file names it alike; it is independent of the data (the same bytes in
  another registry get another id) and reveals nothing about them;
* any other identity as it is: a declared name (``name:NAME``, the operator's declaration), a SQL
  source (``sql:<hex>``, a hash of the location, not of the content) or a public built-in dataset.

Concurrency. The first two reports on a new fingerprint may race to draw its id: the insert ignores a
conflict on the fingerprint and both read back the one row that won, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import secrets

from sqlalchemy import select

from veil.registry.database import Database, now
from veil.registry.fingerprints import is_fingerprint
from veil.registry.schema import public_ids

__all__ = ["PREFIX", "known_released_id", "released_id"]

PREFIX = "dataset-"
"""How every random released id starts."""


def known_released_id(db: Database, dataset_id: str) -> str | None:
    """The id ``release/`` names ``dataset_id`` by if one is known, drawing none (reads only)."""
    if not is_fingerprint(dataset_id):
        return dataset_id
    query = select(public_ids.c.public_id).where(public_ids.c.dataset_id == dataset_id)
    with db.reading() as conn:
        found = conn.execute(query).scalar_one_or_none()
    return None if found is None else str(found)


def released_id(db: Database, dataset_id: str) -> str:
    """The id ``release/`` names ``dataset_id`` by (see the module doc); draws and stores a random one
    for a content fingerprint seen for the first time."""
    if not is_fingerprint(dataset_id):
        return dataset_id
    query = select(public_ids.c.public_id).where(public_ids.c.dataset_id == dataset_id)
    with db.reading() as conn:
        found = conn.execute(query).scalar_one_or_none()
    if found is not None:
        return str(found)
    with db.errors(), db.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        drawn = PREFIX + secrets.token_hex(16)
        conn.execute(
            insert(public_ids)
            .values(dataset_id=dataset_id, public_id=drawn, created_at=now())
            .on_conflict_do_nothing(index_elements=["dataset_id"])
        )
        return str(conn.execute(query).scalar_one())
