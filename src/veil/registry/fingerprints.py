"""A named dataset and the files it was read from: one budget, whichever way a job names the file.

Why. ``--dataset-id NAME`` charges ``name:NAME``; the same file without the flag is identified by its
content (``sha256:``/``dir-sha256:``, :mod:`veil.registry.identity`). Unlinked, the two are two budgets,
and forgetting the flag — the honest mistake the identity guards against — would spend the same
records twice. So the registry records the content fingerprint of every file a named run reads
(``veil_budget_fingerprints``, one name per fingerprint), and:

* a run that names the file by its content only, on a fingerprint recorded for ``NAME``, is charged to
  ``NAME`` (its budget, unit and relation apply; refused over budget before a row is read);
* when a run under ``NAME`` (or ``veil budget set --dataset FILE --dataset-id NAME``) first records a
  file, the runs already charged to that file's fingerprint are moved to ``NAME``, in the same
  transaction that admits the run: they count towards the name's spend from then on (refused if their
  neighbouring relation or unit differs from the name's: such spends do not compose);
* a file recorded under one name is refused under another, before a row is read: two names for the
  same records would be two budgets again.

Only content fingerprints are linked: a SQL source is identified by its location, whose content
changes, and a built-in dataset is public; both stay name-only when a name is given. A file edited by
one byte is a new fingerprint (a new dataset unless named), as in :mod:`veil.registry.identity`.

Order of locks. A transaction that links takes the name's row first, then the fingerprint's row; a run
charged to a fingerprint takes that row only, and finds there whether a name claimed it meanwhile
(:func:`name_of` under the lock), so two processes never wait on each other in opposite orders.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from veil.accounting.events import Neighbouring
from veil.errors import ConfigError, InvalidParameterError
from veil.registry.database import lock_dataset, now
from veil.registry.identity import FINGERPRINT_KINDS
from veil.registry.schema import fingerprints, runs, units

__all__ = ["fingerprints_of", "is_fingerprint", "link", "name_of", "refuse_other_name"]


def is_fingerprint(dataset_id: str | None) -> bool:
    """Whether a registry id is a content fingerprint (and so can be recorded for a name)."""
    return dataset_id is not None and dataset_id.startswith(FINGERPRINT_KINDS)


def name_of(conn: Connection, fingerprint: str) -> str | None:
    """The named dataset a fingerprint is recorded for, or None."""
    found = conn.execute(
        select(fingerprints.c.dataset_id).where(fingerprints.c.fingerprint == fingerprint)
    ).first()
    return None if found is None else str(found[0])


def fingerprints_of(conn: Connection, dataset_id: str) -> list[str]:
    """The fingerprints recorded for a named dataset, oldest first."""
    query = (
        select(fingerprints.c.fingerprint)
        .where(fingerprints.c.dataset_id == dataset_id)
        .order_by(fingerprints.c.first_seen, fingerprints.c.fingerprint)
    )
    return [str(f) for f in conn.execute(query).scalars()]


def refuse_other_name(label: str, recorded: str, fingerprint: str) -> ConfigError:
    name = recorded.removeprefix("name:")
    return ConfigError(
        "dataset_id",
        label,
        f"this file ({fingerprint[:19]}…) is recorded as dataset '{name}'; under a second name the same "
        "records would have two budgets; refused before reading a row",
        f"pass --dataset-id {name}",
    )


def link(conn: Connection, dataset_id: str, label: str, fingerprint: str, relation: Neighbouring) -> None:
    """Within a transaction holding the named dataset ``dataset_id``: record ``fingerprint`` for it and
    move the runs charged to the fingerprint under it (see the module doc); raises, writing nothing
    the caller's rollback would not undo, when the fingerprint is another name's or its runs cannot
    be composed with the name's."""
    recorded = name_of(conn, fingerprint)
    if recorded == dataset_id:
        return
    if recorded is not None:
        raise refuse_other_name(label, recorded, fingerprint)
    # Created if missing, so that on PostgreSQL a run inserting the fingerprint's row concurrently
    # waits for this transaction and then finds the name (a row only one of them saw would not).
    row = lock_dataset(conn, fingerprint, fingerprint)
    if row is not None:
        charged = conn.execute(select(runs.c.run_id).where(runs.c.dataset_id == fingerprint)).first()
        if charged is not None and row.neighbouring != relation.value:
            raise InvalidParameterError(
                "neighbouring",
                relation.value,
                f"the runs already charged to this file were accounted under {row.neighbouring}, and "
                "guarantees under different relations cannot be composed into one budget",
                f"run under {row.neighbouring}",
            )
        file_unit = _unit(conn, fingerprint)
        if (charged is not None or file_unit is not None) and file_unit != _unit(conn, dataset_id):
            raise ConfigError(
                "privacy_unit",
                file_unit,
                "this file's recorded privacy unit differs from the named dataset's, so their spends "
                "cannot be composed into one budget",
                "declare the same --privacy-unit on both, or keep them apart under another file",
            )
        conn.execute(runs.update().where(runs.c.dataset_id == fingerprint).values(dataset_id=dataset_id))
    conn.execute(
        fingerprints.insert().values(fingerprint=fingerprint, dataset_id=dataset_id, first_seen=now())
    )


def _unit(conn: Connection, dataset_id: str) -> str | None:
    found = conn.execute(select(units.c.privacy_unit).where(units.c.dataset_id == dataset_id)).first()
    return None if found is None else str(found[0])
