"""Start a command on N local processes through torch.distributed's elastic launcher (torchrun's engine).

``veil train ... --nproc-per-node N`` calls :func:`launch_local` with its own arguments minus that
option: the elastic agent starts N copies of ``python -m veil ...`` with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), each of which calls
:func:`init_from_env` and trains its rank. Several machines use ``torchrun`` itself with the same
command (``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m veil train ...``): the workers cannot tell the difference.

Failure. ``max_restarts=0``: when any rank exits with an error (or is killed), the agent stops the
others and :func:`launch_local` raises :class:`~veil.errors.ConfigError` naming the failed rank; the
run folder then holds rank 0's last checkpoint and ledger, and ``--resume`` continues from there.
"""

from __future__ import annotations

import datetime
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from veil.errors import ConfigError, InvalidParameterError

__all__ = ["COLLECTIVE_TIMEOUT", "init_from_env", "launch_local", "launched_by_torchrun"]

# How long a rank waits in one collective before the run is declared broken (a dead peer).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun or the elastic agent (its environment names a world)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_from_env(timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> tuple[int, int]:
    """Join the process group torchrun's environment describes; ``(rank, world_size)``.

    Backend: NCCL when CUDA is available (each local rank on its own GPU), else gloo. Idempotent.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def launch_local(
    argv: Sequence[str],
    nproc_per_node: int,
    *,
    threads_per_process: int | None = None,
    log_dir: Path | None = None,
) -> None:
    """Run ``python -m veil <argv>`` on ``nproc_per_node`` local processes; return when all succeeded.

    A single-machine rendezvous on a free localhost port (torchrun's ``--standalone``), no restarts.
    ``OMP_NUM_THREADS`` defaults to ``max(1, cores // nproc_per_node)`` unless already set. With
    ``log_dir`` each rank's stdout and stderr go to files there instead of this terminal, and a
    failure quotes the failed rank's last error line.
    """
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise InvalidParameterError(
            "nproc_per_node", nproc_per_node, "the number of processes is a positive count", "pass N ≥ 1"
        )
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = threads_per_process or max(1, cores // nproc_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=None if log_dir is None else DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "veil", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        said = _last_error_line(log_dir, rank) if log_dir is not None else None
        raise ConfigError(
            "rank",
            rank,
            f"a training process failed (exit code {failure.exitcode}"
            + (f": {said}" if said else "")
            + "), so the others were stopped; every step taken so far is in rank 0's ledger",
            "fix the cause, then continue the run with --resume",
        ) from exc


def _last_error_line(log_dir: Path, rank: int) -> str | None:
    """The last ``veil: error:`` line (else the last line) of a rank's captured stderr, if any."""
    for path in sorted(log_dir.rglob(f"{rank}/stderr.log")):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("veil: error:")]
        if errors or lines:
            return (errors or lines)[-1].removeprefix("veil: error: ")[:300]
    return None
