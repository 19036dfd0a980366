"""The run folder every job writes: file names, the default and checked ``--out``, atomic writes.

A job checks its folder (:func:`check_out`) before it computes anything expensive and writes every
file atomically (:func:`write_files`: temp file, fsync, rename, from :mod:`veil.accounting.ledger`),
so an interrupted or refused job never leaves a half-written file, and never overwrites another
run. Checkpoints and resume live in :mod:`veil.pipeline.checkpoints`.

A run folder a data-protection officer can act on: ``release/`` holds what the guarantee covers
(the released model or table, and the public report page and JSON, without the ``non_private``
section), publishable as is (folder 0755, files 0644); everything else beside it is internal and
owner-only (folders 0700, files 0600) whatever the umask: the CLI runs every command under umask 077
(:func:`owner_only`), :func:`write_files` writes 0600, and :func:`seal` sets the modes again once the
job has written its report (for runs through the Python API).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path

from veil.accounting.ledger import atomic_write_bytes
from veil.errors import ConfigError

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "LEDGER",
    "RELEASE",
    "check_out",
    "default_out",
    "owner_only",
    "seal",
    "write_files",
    "write_release",
]

LEDGER = "ledger.jsonl"
CONFIG = "config.toml"
CHECKPOINTS = "checkpoints"
RELEASE = "release"
_PRIVATE_FILE, _PRIVATE_DIR = 0o600, 0o700
_PUBLIC_FILE, _PUBLIC_DIR = 0o644, 0o755


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


def write_files(folder: Path, files: Mapping[str, bytes | str], *, public: bool = False) -> None:
    """Create ``folder`` if needed and write each file atomically (text as UTF-8), in order.

    Owner-only (folder 0700 when created, files 0600) unless ``public`` (``release/``: 0755, 0644)."""
    folder_mode, file_mode = (_PUBLIC_DIR, _PUBLIC_FILE) if public else (_PRIVATE_DIR, _PRIVATE_FILE)
    if not folder.exists():
        folder.mkdir(parents=True, mode=folder_mode)
        os.chmod(folder, folder_mode)  # mkdir's mode is cut by the umask
    for name, content in files.items():
        data = content.encode("utf-8") if isinstance(content, str) else content
        atomic_write_bytes(folder / name, data, mode=file_mode)


def write_release(run_dir: Path, files: Mapping[str, bytes | str], *, mtime: float = 0.0) -> None:
    """Write ``run_dir/release/``: what the guarantee covers, publishable as is (0755 / 0644).

    Every file in it and the folder itself are then dated ``mtime`` (POSIX seconds; a public time,
    :func:`veil.report.publish.release_time`): a write time would tell how long the run took, which
    grows with the private rows."""
    folder = Path(run_dir) / RELEASE
    write_files(folder, files, public=True)
    os.chmod(folder, _PUBLIC_DIR)
    for path in folder.iterdir():
        if not path.is_symlink():
            os.utime(path, (mtime, mtime))
    os.utime(folder, (mtime, mtime))


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Run the block under umask 077: every file and folder it creates is owner-only."""
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


def seal(run_dir: Path) -> None:
    """Make everything in ``run_dir`` but ``release/`` owner-only (folders 0700, files 0600).

    Called once a job has written its report, whatever created the files (a ledger, a checkpoint, a
    library's own writer); links are left alone."""
    run_dir = Path(run_dir)
    os.chmod(run_dir, _PRIVATE_DIR)
    for root, dirs, names in os.walk(run_dir):
        here = Path(root)
        if here == run_dir and RELEASE in dirs:
            dirs.remove(RELEASE)
        for d in dirs:
            if not (here / d).is_symlink():
                os.chmod(here / d, _PRIVATE_DIR)
        for n in names:
            path = here / n
            if not path.is_symlink() and stat.S_ISREG(path.lstat().st_mode):
                os.chmod(path, _PRIVATE_FILE)
