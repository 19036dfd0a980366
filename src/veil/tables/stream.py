"""Poisson-sampled batches streamed from a Parquet file larger than memory.

Design. DP-SGD's accounting assumes that every row joins every step's batch independently with
probability ``q`` (Poisson sampling). Which rows join which step does not depend on the model, so the
draws for a *window* of ``W`` consecutive steps can be made together, in one pass over the file:

1. read one row group (only the schema's columns), encode it with the schema's encoder;
2. for each of the ``W`` steps draw an independent Bernoulli(q) mask over the group's rows
   (:meth:`~veil.mechanisms.rng.RandomSource.bernoulli`: the realised probability is never above
   ``q``) and append the selected encoded rows to that step's batch;
3. after the last row group, yield the ``W`` batches in order; start the next window.

Every (row, step) inclusion is an independent Bernoulli(q) draw, exactly as in the in-memory
:class:`veil.sampling.PoissonBatchSampler`, so the same ``PoissonSampled(q, ·)`` event accounts for
each step. Only the order in which the draws are made differs.

Limits. The number of rows ``N`` (from the file's metadata) is treated as public, as in ``q = B/N``
everywhere in veil. The file is read once per window: I/O is ``N·steps/W`` rows, memory is about
``W·q·N`` encoded rows plus one row group (choose ``W`` from the memory you have: ``window_rows``).
Encoding must be data-independent — a schema's encoder is; a preprocessing that needs a pass over
the data (a DP mean) is not available when streaming. Row groups should be a few MB to a few hundred
MB; a file written as one huge row group is read whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from veil.errors import InvalidParameterError
from veil.tables.encoder import EncodedTable, TableEncoder

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource

__all__ = ["parquet_rows", "poisson_parquet_batches"]


def parquet_rows(path: str | Path) -> int:
    """The number of rows of a Parquet file, from its metadata (no row is read)."""
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(str(path)).metadata.num_rows)


def poisson_parquet_batches(
    path: str | Path,
    encoder: TableEncoder,
    sampling_rate: float,
    steps: int,
    rng: RandomSource,
    *,
    window_rows: int = 2_000_000,
) -> Iterator[EncodedTable]:
    """Yield ``steps`` Poisson-sampled, encoded batches from the Parquet file (see the module docstring).

    ``window_rows`` bounds the expected number of sampled rows held at once (``W·q·N``).
    """
    import pyarrow.parquet as pq

    from veil.tables.sources import RawTable, TableSource, check_columns

    if not 0 < sampling_rate <= 1:
        raise InvalidParameterError("sampling_rate", sampling_rate, "q is a probability", "pass 0 < q ≤ 1")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InvalidParameterError("steps", steps, "a number of steps", "pass an int ≥ 0")
    source = TableSource("parquet", str(path))
    pf = pq.ParquetFile(str(path))
    check_columns(encoder.schema, pf.schema_arrow.names, source.describe(), need_target=True)
    columns = [c.name for c in encoder.schema.columns if c.used]
    n = int(pf.metadata.num_rows)
    window = max(1, min(steps, int(window_rows // max(1.0, sampling_rate * n))))
    done = 0
    while done < steps:
        w = min(window, steps - done)
        xs: list[list[np.ndarray]] = [[] for _ in range(w)]
        ys: list[list[np.ndarray]] = [[] for _ in range(w)]
        offset = 0
        for g in range(pf.num_row_groups):
            raw = RawTable(pf.read_row_group(g, columns=columns), source, first_row=offset + 1)
            encoded = encoder.encode(raw)
            assert encoded.y is not None
            rows = raw.table.num_rows
            for s in range(w):
                mask = np.asarray(rng.bernoulli(rows, sampling_rate), dtype=bool)
                xs[s].append(encoded.x[mask])
                ys[s].append(encoded.y[mask])
            offset += rows
        for s in range(w):
            yield EncodedTable(
                x=np.concatenate(xs[s]) if xs[s] else np.zeros((0, encoder.width), np.float32),
                y=np.concatenate(ys[s]) if ys[s] else np.zeros(0, np.int64),
                feature_names=list(encoder.feature_names),
                classes=encoder.classes,
            )
            xs[s], ys[s] = [], []
        done += w
