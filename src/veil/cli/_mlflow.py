"""``--mlflow [TRACKING_URI]`` and ``--mlflow-non-private``, shared by every job that writes a run folder
(see :mod:`veil.mlflow_log`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import typer

from veil.errors import ConfigError

__all__ = ["MLFLOW", "MLFLOW_NON_PRIVATE", "check_mlflow_flags", "log_if_asked", "with_default_uri"]

FLAG = "--mlflow"

MLFLOW = typer.Option(
    None,
    FLAG,
    metavar="[TRACKING_URI]",
    help="Log the run to MLflow, release-safe: parameters, the ε curve, the release readiness, the public "
    "report files. Without a URI: a local SQLite store (mlflow.db) next to the run folder.",
)

MLFLOW_NON_PRIVATE = typer.Option(
    False,
    "--mlflow-non-private",
    help="With --mlflow: also log the report's non-private numbers (exact accuracies, counts; not covered "
    "by the guarantee) in a child run of their own, tagged veil.non_private=true and "
    "veil.release_ready=false; never in the release run.",
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


def check_mlflow_flags(uri: str | None, non_private: bool) -> None:
    """Refuse ``--mlflow-non-private`` without ``--mlflow``, and a tracking location MLflow will not log
    to (:func:`veil.mlflow_log.check_tracking_uri`), before the job runs: nothing charged."""
    if uri is not None:
        from veil.mlflow_log import check_tracking_uri

        check_tracking_uri(uri)
    if non_private and uri is None:
        raise ConfigError(
            "mlflow-non-private",
            True,
            "it says what to log to MLflow, and --mlflow (where to log) is not given",
            "add --mlflow [TRACKING_URI], or drop --mlflow-non-private",
        )


def log_if_asked(report: Mapping[str, Any], uri: str | None, job: str, non_private: bool = False) -> None:
    """Log the finished job's report to MLflow when ``--mlflow`` was given (its non-private numbers too,
    in a child run, with ``--mlflow-non-private``). Whatever MLflow raises (a server that does not
    answer, a store it refuses) is one line, :class:`~veil.cli._output.FailedAfterTheJob` (exit 1):
    the job's run folder and ``release/`` stand as written."""
    if uri is None:
        return
    from veil.cli._output import FailedAfterTheJob
    from veil.mlflow_log import log_report

    try:
        log_report(report, uri, job=job, non_private=non_private)
    except Exception as exc:  # a VeilError too: after the charge, exit 2 ("nothing charged") is untrue
        why = " ".join(str(exc).split())[:300]
        raise FailedAfterTheJob(
            f"the job finished and its release is complete in {report.get('out_dir')}/release, but "
            f"logging it to MLflow at {uri!r} failed ({type(exc).__name__}: {why}); the run is not in "
            "MLflow: fix the tracking store before the next job"
        ) from None
