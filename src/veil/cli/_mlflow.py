"""``--mlflow [TRACKING_URI]``, shared by every job that writes a run folder (see :mod:`veil.mlflow_log`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import typer

__all__ = ["MLFLOW", "log_if_asked", "with_default_uri"]

FLAG = "--mlflow"

MLFLOW = typer.Option(
    None,
    FLAG,
    metavar="[TRACKING_URI]",
    help="Log the run to MLflow: parameters, the ε curve, non-private metrics (labelled), report files. "
    "Without a URI: a local SQLite store (mlflow.db) next to the run folder.",
)


def with_default_uri(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``local`` after a bare ``--mlflow`` (last, or followed by another option), so the
    URI is optional on the command line."""
    out = list(argv)
    for i in range(len(out) - 1, -1, -1):
        if out[i] == FLAG and (i + 1 == len(out) or out[i + 1].startswith("-")):
            from veil.mlflow_log import LOCAL

            out.insert(i + 1, LOCAL)
    return out


def log_if_asked(report: Mapping[str, Any], uri: str | None, job: str) -> None:
    """Log the finished job's report to MLflow when ``--mlflow`` was given."""
    if uri is None:
        return
    from veil.mlflow_log import log_report

    log_report(report, uri, job=job)
