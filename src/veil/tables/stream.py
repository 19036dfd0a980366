"""Training on a Parquet table larger than memory: Poisson-sampled rows read by position, per window.

Design (``veil train --stream``; the whole account is in docs/tables.md):

1. **One scan** (:func:`scan_parquet`), before the run folder exists: every row group is read (the
   schema's columns only), encoded with the schema's encoder and split by the same keyed hash of each
   row's content as the in-memory path (:func:`veil.data.held_out`); a row the schema's per-record
   rules drop is in no split, as in memory, and the training split, its size ``N_train`` and ``q = B/N_train``
   are exactly the in-memory path's. Kept: the file positions of the training rows (4 bytes per row
   below 2³² rows), the first ``eval_rows`` held-out rows for the test metrics, a few training rows for
   the model checks; never the table.
2. **Sampling** is the engine's own :class:`veil.sampling.PoissonBatchSampler` over the ``N_train``
   training rows (each row joins each step independently with probability ``q``, from the run's random
   source): the sampler the accountant assumes, untouched. :class:`WindowedSampler` only draws the next
   steps' index sets ahead, up to ``budget_rows`` sampled rows (a *window* of W steps), and hands them
   to :meth:`ParquetRows.load` before yielding them in order; the draws and their order are those of
   the plain sampler (a test compares them).
3. **Reading**: :meth:`ParquetRows.load` reads each row group holding at least one of the window's rows
   once, takes only those rows (Arrow ``take``), encodes them and caches them; the loader then gathers
   each step's rows from the cache. A window costs one pass over the touched row groups, so the I/O of
   a run is about ``T/W`` passes (T steps), and memory is the window's rows plus one row group.

Guarantee. Which rows join which step is decided by the unchanged Poisson sampler, before and
independently of how they are read; reading, caching and encoding are per row and public given the
schema. So each step is the ``PoissonSampled(q, Gaussian(σ))`` event the ledger charges, over the same
training split as an in-memory run (add/remove-one neighbouring; ``N_train`` treated as public as
everywhere in veil).

Limits. Parquet decodes whole pages, so a window that touches every row group reads the whole file:
with the usual DP batch sizes (q·rows-per-group ≫ 1) each window is one full pass. The sampler draws a
Bernoulli mask of ``N_train`` per step, in chunks (:mod:`veil.tables.sampler`; CPU, not I/O). The scan
hashes every row once in Python (as the in-memory split does). Distributed runs, the one-run audit and
models with a fixed feature front are refused when streaming; the non-private baseline is not run
(it would need the table in memory).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.errors import DataError, InvalidParameterError
from veil.tables.encoder import TableEncoder

if TYPE_CHECKING:
    from veil.sampling import LogicalBatchSampler

__all__ = [
    "DEFAULT_BUDGET_ROWS",
    "DEFAULT_EVAL_ROWS",
    "ParquetRows",
    "StreamScan",
    "WindowedSampler",
    "check_fits_in_memory",
    "parquet_rows",
    "scan_parquet",
]

DEFAULT_BUDGET_ROWS = 1_000_000
"""Sampled rows held at once by default (a window's rows; the row group being read comes on top)."""
DEFAULT_EVAL_ROWS = 100_000
"""Held-out rows kept for the (non-private) test metrics of a streamed run: the first ones in the file."""
PROBE_ROWS = 256
"""Training rows kept for the model checks that run before training (per-example independence)."""


def parquet_rows(path: str | Path) -> int:
    """The number of rows of a Parquet file, from its metadata (no row is read)."""
    from veil.tables.sources.common import TableSource
    from veil.tables.sources.parquet_reader import open_parquet

    return int(open_parquet(TableSource("parquet", str(path))).metadata.num_rows)


def _open(path: str | Path, encoder: TableEncoder) -> tuple[Any, list[str], np.ndarray]:
    """The Parquet file (columns checked against the schema), the used columns, row-group starts."""
    from veil.tables.sources.common import TableSource, check_columns
    from veil.tables.sources.parquet_reader import open_parquet

    source = TableSource("parquet", str(path))
    pf = open_parquet(source)
    check_columns(encoder.schema, pf.schema_arrow.names, source.describe(), need_target=True)
    columns = [c.name for c in encoder.schema.columns if c.used]
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    return pf, columns, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits_in_memory(path: str | Path, encoder: TableEncoder, where: str) -> None:
    """Refuse, before a row is read, an in-memory load whose encoded table exceeds the available memory.

    The estimate is the encoded size from the row count in the metadata (the loader needs about that
    plus one batch); the fix is ``--stream``. ``VEIL_MEMORY_BYTES`` overrides the available memory."""
    n_rows = parquet_rows(path)
    need = n_rows * (4 * encoder.width + 8)  # float32 features and int64 labels
    override = os.environ.get("VEIL_MEMORY_BYTES")
    have = int(override) if override else _available_memory()
    if have is not None and need > have:
        raise DataError(
            "dataset",
            where,
            f"the encoded table needs about {need / 2**30:.1f} GiB ({n_rows} rows × "
            f"{encoder.width} features) and {have / 2**30:.1f} GiB of memory is available",
            "pass --stream to train on Poisson-sampled rows read from the file (docs/tables.md)",
        )


@dataclass
class StreamScan:
    """What the scan keeps: training-row positions, a test sample, a probe sample (never the table)."""

    positions: np.ndarray
    """File positions (0-based, ascending) of the training rows: the sampler's index i is row positions[i]."""
    n_rows: int
    n_test: int
    """Held-out rows in the whole file."""
    x_test: np.ndarray
    y_test: np.ndarray
    """The first ``eval_rows`` held-out rows in file order (the test metrics are computed on them)."""
    x_probe: np.ndarray
    y_probe: np.ndarray
    row_groups: int
    units: np.ndarray | None = None
    """Privacy units: each training row's unit key (``units[i]`` for ``positions[i]``; 8 bytes a row),
    the keyed hash of its id (:func:`veil.data.unit_sides`); None for a row-level run."""


def scan_parquet(
    path: str | Path,
    encoder: TableEncoder,
    test_fraction: float,
    seed: int,
    *,
    eval_rows: int = DEFAULT_EVAL_ROWS,
    probe_rows: int = PROBE_ROWS,
    unit_column: str | None = None,
) -> StreamScan:
    """One pass over the file: encode each row group, split it by the keyed hash, keep what a run needs.

    ``unit_column`` (privacy units, :mod:`veil.tables.units`): checked against the file's header
    before a row is read; each row's id is read as text, a row without one is in no split, and the
    split is by the keyed hash of the id (:func:`veil.data.unit_sides`, the in-memory rule), so
    the training rows, their order and their units are exactly those of the in-memory path."""
    from veil.data import held_out
    from veil.tables.sources import RawTable, TableSource

    pf, columns, starts = _open(path, encoder)
    source = TableSource("parquet", str(path))
    if unit_column is not None:
        from veil.tables.units import check_unit_column

        check_unit_column(encoder.schema, pf.schema_arrow.names, unit_column, source.describe())
    n = int(starts[-1])
    index_type = np.uint32 if n < 2**32 else np.int64
    positions = np.empty(n, index_type)  # filled in order, then cut: no list of parts to concatenate
    units = np.empty(n if unit_column is not None else 0, np.uint64)
    n_train = 0
    tests: list[tuple[np.ndarray, np.ndarray]] = []
    probes: list[tuple[np.ndarray, np.ndarray]] = []
    kept_test = kept_probe = n_test = 0
    for g in range(pf.num_row_groups):
        encoded = encoder.encode(
            RawTable(pf.read_row_group(g, columns=columns), source, first_row=int(starts[g]) + 1), drop=False
        )
        assert encoded.y is not None and encoded.dropped is not None
        valid = ~encoded.dropped  # a row the schema's rules drop (label or feature) is in no split
        keys = None
        if unit_column is not None:  # a row without a unit id belongs to no one: in no split
            known, keys, test = _unit_sides(pf, g, unit_column, valid, test_fraction, seed)
            valid &= known
        if not valid.all():
            encoded.x, encoded.y = encoded.x[valid], encoded.y[valid]
        if keys is None:
            test = held_out(encoded.x, encoded.y, test_fraction, seed)
        train_rows = np.flatnonzero(valid)[~test] + starts[g]
        positions[n_train : n_train + len(train_rows)] = train_rows
        if keys is not None:
            units[n_train : n_train + len(train_rows)] = keys[~test]
        n_train += len(train_rows)
        n_test += int(test.sum())
        if kept_test < eval_rows and test.any():
            x, y = encoded.x[test][: eval_rows - kept_test], encoded.y[test][: eval_rows - kept_test]
            tests.append((x.copy(), y.copy()))
            kept_test += len(y)
        if kept_probe < probe_rows and (~test).any():
            x, y = encoded.x[~test][: probe_rows - kept_probe], encoded.y[~test][: probe_rows - kept_probe]
            probes.append((x.copy(), y.copy()))
            kept_probe += len(y)
    train = positions[:n_train]  # a view: 4 bytes per row of the file below 2³² rows
    if n_train == 0:  # N = 0, public by convention; an empty test side is not refused (no test metric)
        raise DataError(
            "dataset",
            "N = 0 training examples" if unit_column is None else "N = 0 training units",
            f"a test fraction of {test_fraction} leaves nothing to train on",
            "provide more examples or lower test_fraction",
        )

    def stack(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        if not parts:  # no held-out row: no test metric (an empty test side is not refused)
            return np.zeros((0, encoder.width), np.float32), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    x_test, y_test = stack(tests)
    x_probe, y_probe = stack(probes)
    return StreamScan(
        train,
        n,
        n_test,
        x_test,
        y_test,
        x_probe,
        y_probe,
        pf.num_row_groups,
        units[:n_train] if unit_column is not None else None,
    )


def _unit_sides(
    pf: Any, group: int, column: str, valid: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row group ``group``'s unit ids (text): ``(known, keys, test)`` of :func:`veil.data.unit_sides`,
    ``known`` over the whole group, ``keys`` and ``test`` over its rows that stay (``valid`` and known)."""
    from veil.data import unit_sides
    from veil.tables.units import unit_texts

    ids = unit_texts(pf.read_row_group(group, columns=[column]).column(column))
    known = np.array([v is not None for v in ids], dtype=bool)
    kept = [v for v, keep in zip(ids, valid & known, strict=True) if keep]
    _, keys, test = unit_sides(kept, test_fraction, seed)
    return known, keys, test


@dataclass
class ReadStats:
    """What the reader did: passes over the file, rows decoded and encoded, the most rows held at once."""

    windows: int = 0
    groups_read: int = 0
    rows_decoded: int = 0
    rows_encoded: int = 0
    peak_rows: int = 0
    direct_reads: int = 0
    window_steps: list[int] = field(default_factory=list)


class ParquetRows:
    """The training rows of a Parquet file by index (``len`` = ``N_train``), read by position.

    :meth:`load` caches a window's rows (one read of each touched row group); :meth:`fetch` gathers
    rows from the cache, or reads them directly when they were not loaded (the model checks' probes)."""

    def __init__(self, path: str | Path, encoder: TableEncoder, positions: np.ndarray) -> None:
        self.path = str(path)
        self.encoder = encoder
        self.positions = positions
        self._pf, self._columns, self._starts = _open(path, encoder)
        self._cache_pos = np.zeros(0, np.int64)
        self._cache_x = np.zeros((0, encoder.width), np.float32)
        self._cache_y = np.zeros(0, np.int64)
        self.stats = ReadStats()

    def __len__(self) -> int:
        return len(self.positions)

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encoded rows at the sorted, unique file positions ``rows``: each touched row group read once."""
        from veil.tables.sources import RawTable, TableSource

        source = TableSource("parquet", self.path)
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        x = np.empty((len(rows), self.encoder.width), np.float32)  # filled group by group: no concatenation
        y = np.empty(len(rows), np.int64)
        held = 0
        for g in np.unique(groups):
            local = rows[groups == g] - self._starts[g]
            table = self._pf.read_row_group(int(g), columns=self._columns)
            self.stats.groups_read += 1
            self.stats.rows_decoded += table.num_rows
            self.stats.peak_rows = max(self.stats.peak_rows, len(rows) + len(self._cache_y) + table.num_rows)
            encoded = self.encoder.encode(RawTable(table.take(local), source))
            del table
            assert encoded.y is not None
            x[held : held + len(local)] = encoded.x
            y[held : held + len(local)] = encoded.y
            held += len(local)
        self.stats.rows_encoded += held
        return x, y

    def load(self, index_sets: list[np.ndarray]) -> None:
        """Cache the rows of a window of steps (indices into the training rows), dropping the last window."""
        self._cache_pos = np.zeros(0, np.int64)
        self._cache_x, self._cache_y = self._cache_x[:0], self._cache_y[:0]
        wanted = np.unique(np.concatenate([np.asarray(i, np.int64) for i in index_sets]))
        rows = self.positions[wanted].astype(np.int64)
        self._cache_x, self._cache_y = self._read(rows)
        self._cache_pos = rows
        self.stats.windows += 1
        self.stats.window_steps.append(len(index_sets))
        self.stats.peak_rows = max(self.stats.peak_rows, len(rows))

    def fetch(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Encoded features and labels of the training rows ``indices``, in that order."""
        rows = self.positions[np.asarray(indices, np.int64)].astype(np.int64)
        k = np.searchsorted(self._cache_pos, rows)
        k = np.minimum(k, max(len(self._cache_pos) - 1, 0))
        if len(self._cache_pos) and np.array_equal(self._cache_pos[k], rows):
            return self._cache_x[k], self._cache_y[k]
        unique, inverse = np.unique(rows, return_inverse=True)
        self.stats.direct_reads += 1
        x, y = self._read(unique)
        return x[inverse], y[inverse]


class WindowedSampler:
    """Wraps a logical batch sampler: draws the next steps' batches ahead (up to ``budget_rows`` sampled
    rows, at least one step), has ``rows`` load them, then yields them in order with their tokens.

    The draws are the wrapped sampler's, made in the same order: only *when* they are made changes.
    Resume tokens are the wrapped sampler's (``token``/``load_token`` pass through)."""

    def __init__(self, inner: LogicalBatchSampler, rows: ParquetRows, budget_rows: int) -> None:
        if isinstance(budget_rows, bool) or not isinstance(budget_rows, int) or budget_rows < 1:
            raise InvalidParameterError(
                "stream_rows", budget_rows, "it bounds the sampled rows held at once", "pass an int ≥ 1"
            )
        self.inner = inner
        self.rows = rows
        self.budget_rows = budget_rows
        self.steps_per_epoch = inner.steps_per_epoch

    def logical_batches(self) -> Iterator[tuple[list[int], dict[str, Any]]]:
        batches = self.inner.logical_batches()
        pending = next(batches, None)
        while pending is not None:
            window = [pending]
            total = len(pending[0])
            pending = next(batches, None)
            while pending is not None and total + len(pending[0]) <= self.budget_rows:
                window.append(pending)
                total += len(pending[0])
                pending = next(batches, None)
            self.rows.load([np.asarray(indices, np.int64) for indices, _ in window])
            yield from window

    def token(self) -> dict[str, Any]:
        return self.inner.token()

    def load_token(self, token: dict[str, Any]) -> None:
        self.inner.load_token(token)
