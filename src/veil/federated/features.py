"""The fixed front's features of every training row, computed once per simulated run and shared.

A fixed front (the scattering transform, random Fourier features) has no trained parameter and is
drawn from a public seed; it maps each example on its own. Its features of the training rows are
therefore the same whichever client holds a row, and computing them is the costly part of a
simulated client's round (Flower's simulation engine runs clients in several worker processes,
each of which used to compute them again for every client it served). The run computes them once,
before the simulation starts, into one ``.npy`` file that every worker memory-maps and indexes by
its client's rows.

Privacy: the file is a function of private rows, so it is kept like the run's other internal files
(inside the run folder, never under ``release/``; file 0600, folder 0700 whatever the umask) and is
removed when the simulation ends. Nothing about it is released and no accounting changes: a client
reads exactly the rows of its partition, as before, and gets the same numbers as its own
computation (``tests/test_federated_features.py``).

The file name carries a key (:func:`cache_key`) over everything that decides the features — the
front's public description and the data's fingerprint — so a file from another front or other data
is never read in its place; a worker that finds no file (a deployed SuperNode holding its own data)
computes its client's features itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from veil.models import fixed_features

__all__ = ["FEATURES_DIR", "cache_key", "forget_mappings", "read_rows", "write_features"]

FEATURES_DIR = "features"
"""The run folder's sub-folder of the shared features (internal: never released)."""

_CHUNK = 1024
"""Examples through the front at once while writing (bounds the front's temporaries)."""


def cache_key(description: Mapping[str, Any]) -> str:
    """A short hash of the front's public description and the data's fingerprint (JSON, sorted)."""
    blob = json.dumps(dict(description), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def write_features(front: nn.Module, x: np.ndarray, path: Path) -> None:
    """``front`` applied to every row of ``x``, written to ``path`` (``.npy``, float32) chunk by chunk
    into a memory-mapped file, then renamed into place: a reader never sees a half-written file, and
    memory is one chunk's work, not the whole feature matrix. Owner-only modes (0700/0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".partial")
    try:
        shape = fixed_features(front, x[:0]).shape[1:]  # the front's output shape, from a blank example
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(x), *shape))
        try:
            os.chmod(tmp, 0o600)
            for i in range(0, len(x), _CHUNK):
                out[i : i + _CHUNK] = fixed_features(front, x[i : i + _CHUNK])
            out.flush()
        finally:
            del out
        os.replace(tmp, path)
    except BaseException:  # a failed write (a full disk, an interrupt) leaves no private features
        tmp.unlink(missing_ok=True)
        raise


def remove_leftovers(folder: Path) -> None:
    """Delete shared-feature files a killed run left behind (a run removes its own when it ends)."""
    for stale in folder.glob("train-*.npy*"):
        stale.unlink(missing_ok=True)


@functools.lru_cache(maxsize=2)
def _mapped(path: str) -> np.ndarray:
    return np.load(path, mmap_mode="r")


def read_rows(path: Path, rows: np.ndarray) -> np.ndarray:
    """The features of the given rows (a copy in memory; the file itself stays mapped, shared by the
    processes that read it through the page cache)."""
    return np.array(_mapped(str(path))[np.asarray(rows, dtype=np.int64)], dtype=np.float32)


def forget_mappings() -> None:
    """Drop this process's mappings of shared feature files (once a run removed its file: an open
    mapping would keep the deleted file's pages alive)."""
    _mapped.cache_clear()
