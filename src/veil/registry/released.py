"""The files each run published, by content: what lets ``--init-from`` see a DP release of a dataset
whatever its path.

Why. ``release/model.pt`` is a DP release of its run's rows. Starting a run on the same rows from it
would make the new model a function of two runs on those rows while its report states the second's ε
alone. The file can be copied, renamed or moved away from its run folder, so its path and the files
beside it are no proof of where it came from; its content is. So :func:`record` keeps the SHA-256 of
every file a run publishes (``veil_budget_released_files``, written by
:func:`veil.report.publish.publish` as it writes ``release/``), and :func:`datasets_releasing` gives
the datasets whose runs published a file with a given hash (through the runs' current dataset: a
link that moves a file's runs under a name moves their files with them).

Only hashes of released files and the run id are stored: nothing of the data.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import select

from veil.registry.database import Database, now
from veil.registry.schema import released_files, runs

__all__ = ["datasets_releasing", "record"]


def record(db: Database, run_id: str, files: Mapping[str, str]) -> None:
    """Record that run ``run_id`` published ``files`` (name → SHA-256 hex); a file recorded already
    for the run is left as it is."""
    with db.errors(), db.engine.begin() as conn:
        have = set(
            conn.execute(select(released_files.c.sha256).where(released_files.c.run_id == run_id)).scalars()
        )
        for name, sha256 in files.items():
            if sha256 not in have:
                conn.execute(
                    released_files.insert().values(sha256=sha256, run_id=run_id, name=name, recorded_at=now())
                )
                have.add(sha256)


def datasets_releasing(db: Database, sha256: str) -> set[str]:
    """The datasets (registry ids) one of whose runs published a file with content ``sha256``."""
    query = (
        select(runs.c.dataset_id)
        .join(released_files, released_files.c.run_id == runs.c.run_id)
        .where(released_files.c.sha256 == sha256)
    )
    with db.reading() as conn:
        return {str(d) for d in conn.execute(query).scalars()}
