"""One rank of a multi-process ``veil train`` (each ``python -m veil train`` started by the launcher,
:func:`veil.distributed.job.launch_train`, or by ``torchrun`` on several machines).

Every rank runs the ordinary train job (:func:`veil.training.run.train`), whose engine then trains
across ranks (``make_private(distributed=True)``: sharded Poisson sampling, one all-reduce of the
clipped sums per step, the noise added once). Rank 0 trains in the real run folder and is its
only writer: ledger (each step charged and fsync'ed before its update), checkpoints, report with
``"world_size"``, and the one charge to the privacy-budget registry. The other ranks keep the same
bookkeeping (ledger and registry) in a private scratch folder that is deleted afterwards, so they
take the same steps and stop at the same step; on ``--resume`` rank 0 sends them its ledger,
configuration and checkpoints (a broadcast, so no shared file system is needed), and every rank
continues from the same state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from veil.distributed.job import refuse_audit

__all__ = ["train_as_rank"]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """What another rank needs to resume: ledger, configuration, checkpoints, released preprocessing."""
    from veil.pipeline.run_folder import CHECKPOINTS, CONFIG, LEDGER

    files = [run_dir / LEDGER, run_dir / CONFIG, run_dir / "preprocessing.json"]
    files += sorted((run_dir / CHECKPOINTS).glob("*.pt"))
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


def train_as_rank(
    config_file: str | None, given: dict[str, Any], resume: str | None
) -> dict[str, Any] | None:
    """One rank of ``veil train`` (see the module docstring): rank 0's report dict, None elsewhere."""
    import torch.distributed as dist

    from veil.config import load_config_file, resolve_config, snake_keys
    from veil.distributed.launch import init_from_env
    from veil.training.run import train

    rank, _ = init_from_env()
    scratch = None if rank == 0 else Path(tempfile.mkdtemp(prefix=f"veil-rank{rank}-"))
    if scratch is not None:  # the budget registry is charged once, by rank 0; the others charge a scratch one
        from veil.registry.location import ENV_VAR

        os.environ[ENV_VAR] = str(scratch / "budget.db")
    try:
        values: dict[str, Any] = dict(load_config_file(config_file)) if config_file is not None else {}
        values.update(given)
        refuse_audit(snake_keys(values))
        if resume is None:
            cfg = resolve_config(config_file, given)
            if scratch is not None:  # the same run, bookkept privately; the baseline is rank 0's job
                cfg = cfg.model_copy(
                    update={"out": str(scratch / "run"), "baseline": False, "progress": False}
                )
            report = train(cfg)
        else:
            shared: list[Any] = [_snapshot(Path(resume)) if rank == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            values = {k: v for k, v in snake_keys(values).items() if k != "out"}
            folder = Path(resume)
            if scratch is not None:
                folder = scratch / "run"
                for name, data in shared[0].items():
                    (folder / name).parent.mkdir(parents=True, exist_ok=True)
                    (folder / name).write_bytes(data)
                values.update(baseline=False, progress=False)
            report = train(values, resume=folder)
        return report.to_dict() if scratch is None else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
