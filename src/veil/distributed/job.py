"""``veil train`` across processes, the launcher side (``--nproc-per-node N``); the rank side is the
train job's :mod:`veil.training.rank`.

Launcher (:func:`launch_train`, the ``veil train`` process the user started). It resolves the
configuration and the run folder once (so every rank trains the same run), refuses what cannot run
across ranks before anything starts, then starts N ranks through torch.distributed's elastic agent
(:func:`veil.distributed.launch.launch_local`) with each rank's output in a log folder, and returns
rank 0's ``report.json``. A rank that fails stops the others; the error names the rank, quotes its
last error line, and says to ``--resume``. The launcher never imports the train job: each rank is a
new ``python -m veil train`` process.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veil.errors import ConfigError

__all__ = ["launch_train", "refuse_audit"]


def refuse_audit(values: Mapping[str, Any]) -> None:
    """``--audit`` across ranks is refused before any rank starts (launcher) or trains (rank)."""
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
            refuse_audit(cfg.model_dump())
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
            refuse_audit(values)
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
