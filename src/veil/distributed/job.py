"""``veil train`` across processes: the launcher side (``--nproc-per-node N``) and the rank side.

Launcher (:func:`launch_train`, the ``veil train`` process the user started). It resolves the
configuration and the run folder once (so every rank trains the same run), refuses what cannot run
across ranks before anything starts, then starts N ranks through torch.distributed's elastic agent
(:func:`veil.distributed.launch.launch_local`) with each rank's output in a log folder, and returns
rank 0's ``report.json``. A rank that fails stops the others; the error names the rank, quotes its
last error line, and says to ``--resume``.

Rank (:func:`train_as_rank`, each ``python -m veil train`` started by the launcher or by ``torchrun``
on several machines). Every rank runs the ordinary ``veil.train`` job, whose engine then trains
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

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veil.errors import ConfigError

__all__ = ["launch_train", "train_as_rank"]


def _refuse_audit(values: Mapping[str, Any]) -> None:
    if values.get("audit"):
        raise ConfigError(
            "audit",
            True,
            "the one-run canary audit injects canaries into one process's batches and scores them "
            "there; across ranks that bookkeeping is not implemented",
            "run the audit in one process (without --nproc-per-node)",
        )


def _refuse_unit(values: Mapping[str, Any]) -> None:
    """Before any rank starts: unit sampling (:mod:`veil.units`) runs in one process."""
    if values.get("privacy_unit"):
        raise ConfigError(
            "privacy_unit",
            values["privacy_unit"],
            "unit-level DP-SGD samples units in one process; across ranks it is not implemented",
            "train a privacy-unit run in one process (drop --nproc-per-node)",
        )


def launch_train(
    config_file: str | None, given: dict[str, Any], resume: str | None, nproc_per_node: int
) -> dict[str, Any]:
    """Run ``veil train`` on ``nproc_per_node`` local ranks; rank 0's report as a dict."""
    from veil.config import config_to_toml, load_config_file, make_config, resolve_config, snake_keys
    from veil.distributed.launch import launch_local
    from veil.pipeline.run_folder import check_out, default_out

    with tempfile.TemporaryDirectory(prefix="veil-launch-") as tmp:
        settings = Path(tmp) / "settings.toml"
        if resume is None:
            cfg = resolve_config(config_file, given)
            _refuse_audit(cfg.model_dump())
            _refuse_unit(cfg.model_dump())
            out = Path(cfg.out) if cfg.out is not None else default_out(cfg.dataset)
            check_out(out)
            cfg = cfg.model_copy(update={"out": str(out), "progress": False})
            settings.write_text(config_to_toml(cfg))
            argv = ["train", str(settings)]
        else:
            values: dict[str, Any] = dict(load_config_file(config_file)) if config_file is not None else {}
            values.update(given)
            values["progress"] = False
            make_config(values)  # typos and wrong types are refused before any rank starts
            _refuse_audit(values)
            _refuse_unit(values)
            settings.write_text(_toml(snake_keys(values)))
            out = Path(resume)
            argv = ["train", str(settings), "--resume", str(out)]
        launch_local(argv, nproc_per_node, log_dir=Path(tmp) / "logs")
        return dict(json.loads((out / "report.json").read_text()))


def _toml(values: Mapping[str, Any]) -> str:
    """Top-level scalar settings as TOML (the overrides a resume passes on)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float, str)):
            lines.append(f"{key} = {json.dumps(value)}")
        else:
            raise ConfigError(key, value, "only plain settings can be passed on to the ranks", "use a flag")
    return "\n".join(lines) + "\n"


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
    from veil.training import train

    rank, _ = init_from_env()
    scratch = None if rank == 0 else Path(tempfile.mkdtemp(prefix=f"veil-rank{rank}-"))
    if scratch is not None:  # the budget registry is charged once, by rank 0; the others charge a scratch one
        from veil.registry.location import ENV_VAR

        os.environ[ENV_VAR] = str(scratch / "budget.db")
    try:
        values: dict[str, Any] = dict(load_config_file(config_file)) if config_file is not None else {}
        values.update(given)
        _refuse_audit(snake_keys(values))
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
