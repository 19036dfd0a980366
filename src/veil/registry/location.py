"""Where the budget registry lives: an explicit URL, ``VEIL_BUDGET_DB``, or a SQLite file per user.

Order: the ``url`` argument (``--db``), then the environment variable ``VEIL_BUDGET_DB``, then
``$XDG_DATA_HOME/veil/budget.db``, then ``~/.local/share/veil/budget.db``. A value with ``://`` is a
SQLAlchemy URL (``postgresql://user@host/db`` for a team); anything else is the path of a SQLite file.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "default_path", "resolve_url"]

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
