"""Where the budget registry lives: an explicit URL, ``VEIL_BUDGET_DB``, or a SQLite file per user.

Order: the ``url`` argument (``--db``), then the environment variable ``VEIL_BUDGET_DB``, then
``$XDG_DATA_HOME/veil/budget.db``, then ``~/.local/share/veil/budget.db``. A value with ``://`` is a
SQLAlchemy URL (``postgresql://user@host/db`` for a team); anything else is the path of a SQLite file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["ENV_VAR", "default_path", "registry_location", "resolve_url"]

ENV_VAR = "VEIL_BUDGET_DB"


def default_path() -> Path:
    """The per-user SQLite file (XDG data directory)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "veil" / "budget.db"


def resolve_url(url: str | os.PathLike[str] | None = None) -> str:
    """The SQLAlchemy URL of the registry (see the module doc for the order)."""
    value = os.fspath(url) if url is not None else os.environ.get(ENV_VAR) or None
    if value is None:
        value = str(default_path())
    if "://" in value:
        return value
    return "sqlite:///" + str(Path(value).expanduser().resolve())


@contextmanager
def registry_location(url: str | os.PathLike[str] | None) -> Iterator[None]:
    """Within the block, the registry is ``url`` (a job's ``--db``); None leaves the usual order.

    Set as ``VEIL_BUDGET_DB`` for the block (and restored after it), so that every charge the job makes,
    in this process or in the processes it starts (torchrun ranks, teacher workers), reaches the same
    registry without each job carrying the location through its own settings."""
    if url is None:
        yield
        return
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = os.fspath(url)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
