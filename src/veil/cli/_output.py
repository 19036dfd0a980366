"""Shared output for subcommands: one JSON object with ``--json``, else a small table."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any


class FailedAfterTheJob(Exception):
    """A step after the job failed (logging its report to MLflow): the job itself ran, was charged and
    wrote its run folder and ``release/``, unchanged. The entry point prints ``veil: error: MESSAGE``
    as the one line and exits 1 — not 2, which says bad input refused with nothing charged."""


class CommandInterrupted(Exception):
    """Ctrl-C caught by a subcommand that has something to say about it (e.g. how to resume): the
    entry point prints ``veil: MESSAGE`` as the one line and exits 130. A plain Exception, so that the
    command-line framework passes it on instead of turning it into a bare exit status."""


@contextlib.contextmanager
def resume_hint(db: str | None) -> Iterator[None]:
    """An interrupted run that can be continued (:class:`~veil.errors.RunInterrupted`) as the one line
    that says how: its ``--resume`` command, with the same ``--db``."""
    from veil.errors import RunInterrupted

    try:
        yield
    except RunInterrupted as exc:
        again = f" --db {db}" if db else ""
        raise CommandInterrupted(f"{exc}{again}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def emit(result: Mapping[str, Any], as_json: bool, title: str = "") -> None:
    """Print ``result``: one JSON object on stdout, or a two-column table for people."""
    if as_json:
        sys.stdout.write(json.dumps(_jsonable(result), sort_keys=False) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None, show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in result.items():
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        table.add_row(key, shown)
    Console().print(table)
