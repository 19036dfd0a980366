"""The run folder every job writes: file names, the default and checked ``--out``, atomic writes.

A job checks its folder (:func:`check_out`) before it computes anything expensive and writes every
file atomically (:func:`write_files`: temp file, fsync, rename, from :mod:`veil.accounting.ledger`),
so an interrupted or refused job never leaves a half-written file, and never overwrites another
run. Checkpoints and resume live in :mod:`veil.pipeline.checkpoints`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

from veil.accounting.ledger import atomic_write_bytes
from veil.errors import ConfigError

__all__ = ["CHECKPOINTS", "CONFIG", "LEDGER", "check_out", "default_out", "write_files"]

LEDGER = "ledger.jsonl"
CONFIG = "config.toml"
CHECKPOINTS = "checkpoints"


def default_out(dataset: str, job: str = "") -> Path:
    """``runs/[job-]<dataset stem>-<UTC time>``: a new folder name for a run without ``--out``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = Path(dataset.split(":")[-1]).stem or dataset
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in stem) or "data"
    return Path("runs") / f"{job + '-' if job else ''}{safe}-{stamp}"


def check_out(out: Path) -> None:
    """The run folder must be new (or empty) and creatable; nothing is left behind by the check."""
    if out.exists():
        if not out.is_dir():
            raise ConfigError("out", str(out), "it exists and is not a folder", "pass a new folder for --out")
        if (out / LEDGER).exists():
            raise ConfigError(
                "out",
                str(out),
                "it already holds a run, whose outputs and ledger must not be overwritten",
                f"continue it with --resume {out} (a new run on the same data would spend its budget "
                "again: count every run against the data's budget with `veil budget`)",
            )
        if any(out.iterdir()):
            raise ConfigError(
                "out",
                str(out),
                "the folder is not empty and earlier results must not be overwritten",
                "pass a new or empty folder for --out",
            )
    anchor = out
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise ConfigError(
            "out", str(out), f"'{anchor}' is a file, so the folder cannot be created", "pass another --out"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".veil-probe-", dir=anchor)
        os.rmdir(probe)
    except OSError as exc:
        raise ConfigError(
            "out",
            str(out),
            f"the folder cannot be written ({exc.strerror})",
            "pass a writable location for --out",
        ) from None


def write_files(folder: Path, files: Mapping[str, bytes | str]) -> None:
    """Create ``folder`` if needed and write each file atomically (text as UTF-8), in order."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        atomic_write_bytes(folder / name, content.encode("utf-8") if isinstance(content, str) else content)
