"""Poisson-sampled batches streamed from Parquet: each (row, step) inclusion is Bernoulli(q), independent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from veil.mechanisms.rng import make_source  # noqa: E402
from veil.tables.encoder import TableEncoder  # noqa: E402
from veil.tables.schema import ColumnSpec, TableSchema  # noqa: E402
from veil.tables.stream import parquet_rows, poisson_parquet_batches  # noqa: E402

N = 3000


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, TableEncoder]:
    ids = np.arange(N, dtype=np.float64)
    labels = np.where(ids % 3 == 0, "a", "b")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ids, "label": labels}), path, row_group_size=700)
    schema = TableSchema(
        (
            ColumnSpec("id", "numeric", bounds=(0.0, float(N - 1)), missing="error"),
            ColumnSpec("label", "categorical", "target", levels=("a", "b"), unknown="error"),
        ),
        reviewed=True,
    )
    return path, TableEncoder(schema)


def _ids(batch) -> np.ndarray:
    return np.rint((batch.x[:, 0] + 1) / 2 * (N - 1)).astype(int)


def test_streamed_batches_are_encoded_rows_of_the_file(data) -> None:
    path, encoder = data
    assert parquet_rows(path) == N
    for batch in poisson_parquet_batches(path, encoder, 0.05, 5, make_source(False, 1), window_rows=300):
        ids = _ids(batch)
        assert len(np.unique(ids)) == len(ids)  # a row joins a batch at most once
        np.testing.assert_array_equal(batch.y, np.where(ids % 3 == 0, 0, 1))


def test_inclusion_is_bernoulli_q_per_row_and_step(data) -> None:
    """χ² on per-row inclusion counts (Binomial(T, q) each) and a z-test on the batch-size mean.

    Seeded; false-failure rate of each check ≈ 1e-6 for a correct sampler.
    """
    path, encoder = data
    q, steps = 0.02, 400
    counts = np.zeros(N, dtype=int)
    sizes = []
    # A small window forces many passes over the file (window = 2 steps here).
    for batch in poisson_parquet_batches(path, encoder, q, steps, make_source(False, 5), window_rows=130):
        ids = _ids(batch)
        counts[ids] += 1
        sizes.append(len(ids))
    assert len(sizes) == steps
    z = (np.mean(sizes) - q * N) / np.sqrt(q * (1 - q) * N / steps)
    assert abs(z) < 4.9
    observed = np.bincount(counts, minlength=30)[:30]
    expected = stats.binom.pmf(np.arange(30), steps, q) * N
    keep = expected >= 5
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 < stats.chi2.ppf(1 - 1e-6, keep.sum() - 1)
    # Rows of different row groups are not favoured: first vs last group mean inclusion.
    assert abs(counts[:700].mean() - counts[-700:].mean()) < 4.9 * np.sqrt(2 * steps * q / 700)


def test_a_biased_sampler_would_be_caught(data) -> None:
    """The χ² above rejects a sampler that includes rows with probability 1.15·q."""
    path, encoder = data
    q, steps = 0.02, 400
    counts = np.zeros(N, dtype=int)
    for batch in poisson_parquet_batches(
        path, encoder, q * 1.15, steps, make_source(False, 5), window_rows=130
    ):
        counts[_ids(batch)] += 1
    observed = np.bincount(counts, minlength=30)[:30]
    expected = stats.binom.pmf(np.arange(30), steps, q) * N
    keep = expected >= 5
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 > stats.chi2.ppf(1 - 1e-6, keep.sum() - 1)
