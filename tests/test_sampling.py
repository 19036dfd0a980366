"""Poisson and shuffled batch samplers, physical chunking, empty-batch collation, resume tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import Dataset, TensorDataset

from veil.errors import InvalidParameterError, SamplingError
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.sampling import (
    EmptyBatchCollate,
    PoissonBatchSampler,
    PrivateDataLoader,
    ShuffledBatchSampler,
    StepSignal,
    check_sampling_rate,
    split_logical_batch,
    steps_per_epoch,
)


def test_poisson_inclusion_frequency_and_batch_size_spread() -> None:
    n, q, steps = 2000, 0.03, 100
    sampler = PoissonBatchSampler(n, q, steps, SeededSource(11))
    batches = list(sampler)
    assert len(batches) == len(sampler) == steps
    counts = np.zeros(n)
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)
        counts[b] += 1
    # Total inclusions ~ Binomial(n·steps, q): two-sided z-test at |z| < 5 (false failure ≈ 6e-7).
    total, expected = counts.sum(), n * steps * q
    assert abs(total - expected) / math.sqrt(expected * (1 - q)) < 5
    # Batch sizes are Binomial(n, q), not fixed: their sample variance must fit χ²_{steps-1}
    # (two-sided at 1e-6 in all). A fixed-size (shuffled) sampler has variance 0 and fails this.
    sizes = np.array([len(b) for b in batches], dtype=float)
    stat = (steps - 1) * sizes.var(ddof=1) / (n * q * (1 - q))
    assert stats.chi2.ppf(5e-7, steps - 1) < stat < stats.chi2.ppf(1 - 5e-7, steps - 1)
    # Each example is included ~ Binomial(steps, q) times: χ² goodness of fit on the count of
    # examples never included (expected n(1-q)^steps ≈ 95), z-test |z| < 5 (false failure ≈ 6e-7).
    p0 = (1 - q) ** steps
    assert abs((counts == 0).sum() - n * p0) / math.sqrt(n * p0 * (1 - p0)) < 5


def test_empty_batches_are_yielded_not_skipped() -> None:
    n, q, steps = 10, 0.05, 400
    batches = list(PoissonBatchSampler(n, q, steps, SeededSource(3)))
    assert len(batches) == steps
    empty = sum(1 for b in batches if not b)
    p_empty = (1 - q) ** n  # ≈ 0.60
    # Binomial(steps, p_empty), |z| < 5: false failure ≈ 6e-7.
    assert abs(empty - steps * p_empty) / math.sqrt(steps * p_empty * (1 - p_empty)) < 5


def test_poisson_with_secure_source() -> None:
    sampler = PoissonBatchSampler(50, 0.5, 4, SecureSource())
    assert len(list(sampler)) == 4
    assert sampler.token()["rng"] is None


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, 0.1, 1), "dataset_size"),
        ((10, 0.0, 1), "sampling_rate"),
        ((10, 1.5, 1), "sampling_rate"),
        ((10, 0.1, 0), "steps_per_epoch"),
    ],
)
def test_poisson_rejects_bad_arguments(args: tuple[int, float, int], name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        PoissonBatchSampler(*args, SeededSource(0))


def test_poisson_over_zero_examples_yields_empty_batches() -> None:
    """A part whose private size is 0 still takes its planned steps (``make_private(population=)``)."""
    assert [len(b) for b in PoissonBatchSampler(0, 0.5, 3, SeededSource(0))] == [0, 0, 0]


def test_rate_and_steps_come_from_batch_size_and_dataset() -> None:
    assert check_sampling_rate(30, 100) == 0.3
    assert steps_per_epoch(100, 30) == 4
    with pytest.raises(SamplingError, match="batch_size"):
        check_sampling_rate(101, 100)


def test_shuffled_sampler_is_a_permutation_of_fixed_size_batches() -> None:
    sampler = ShuffledBatchSampler(10, 4, 3, SeededSource(5))
    epochs = [list(sampler) for _ in range(2)]
    for batches in epochs:
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sorted(i for b in batches for i in b) == list(range(10))
    assert epochs[0] != epochs[1]  # a fresh permutation each epoch (probability of equality 1/10!)


def test_split_logical_batch() -> None:
    assert split_logical_batch([], 3) == [[]]
    assert split_logical_batch([1, 2], None) == [[1, 2]]
    assert split_logical_batch(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_logical_batch(list(range(6)), 3) == [[0, 1, 2], [3, 4, 5]]


class _DictData(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": torch.ones(2, 5) * i, "label": i, "name": f"ex{i}", "pair": (torch.zeros(3), 1.5)}


def test_empty_batch_collates_to_zero_rows() -> None:
    from torch.utils.data import default_collate

    data = _DictData()
    collate = EmptyBatchCollate(default_collate, data[0])
    empty = collate([])
    assert empty["x"].shape == (0, 2, 5)
    assert empty["label"].shape == (0,)
    assert empty["name"] == []
    assert empty["pair"][0].shape == (0, 3) and empty["pair"][1].shape == (0,)
    full = collate([data[1], data[2]])
    assert full["x"].shape == (2, 2, 5)


def _loader(seed: int, physical: int | None, workers: int = 0) -> PrivateDataLoader:
    from torch.utils.data import default_collate

    ds = TensorDataset(torch.arange(40.0).unsqueeze(1))
    return PrivateDataLoader(
        ds,
        PoissonBatchSampler(40, 0.25, 4, SeededSource(seed)),
        expected_batch_size=10,
        physical_batch_size=physical,
        signal=StepSignal(),
        collate_fn=default_collate,
        template_item=ds[0],
        num_workers=workers,
    )


def _trace(loader: PrivateDataLoader, limit: int | None = None) -> list[tuple[list[int], bool]]:
    out = []
    for (x,) in loader:
        out.append((x[:, 0].long().tolist(), loader.signal.last_chunk))
        if limit is not None and len(out) == limit:
            break
    return out


def test_chunks_and_flags_reassemble_logical_batches() -> None:
    logical = [b for b, _ in _trace(_loader(7, None))]
    chunked = _trace(_loader(7, 3))
    rebuilt, current = [], []
    for chunk, last in chunked:
        assert len(chunk) <= 3
        current += chunk
        if last:
            rebuilt.append(current)
            current = []
    assert rebuilt == logical and current == []
    assert len(rebuilt) == 4


def test_flags_survive_worker_prefetching() -> None:
    # Workers prefetch indices ahead of the training loop: the flag must describe the batch just
    # yielded, not the sampler's current position.
    assert _trace(_loader(9, 2, workers=1)) == _trace(_loader(9, 2, workers=0))


def test_resume_token_continues_mid_epoch_exactly() -> None:
    full = _trace(_loader(21, 3))
    first = _loader(21, 3)
    it = iter(first)
    seen = []
    while sum(1 for _, last in seen if last) < 2:  # consume two logical batches
        (x,) = next(it)
        seen.append((x[:, 0].long().tolist(), first.signal.last_chunk))
    token = first.state_dict()
    assert token["position"] == 2
    resumed = _loader(0, 3)  # different seed: everything must come from the token
    resumed.load_state_dict(token)
    assert seen + _trace(resumed) == full


def test_shuffled_resume_mid_epoch() -> None:
    def make(seed: int) -> ShuffledBatchSampler:
        return ShuffledBatchSampler(12, 4, 3, SeededSource(seed))

    reference = make(4)
    epoch1, epoch2 = list(reference.logical_batches()), list(reference.logical_batches())
    token = epoch1[0][1]
    resumed = make(99)
    resumed.load_token(token)
    assert [b for b, _ in resumed.logical_batches()] == [b for b, _ in epoch1[1:]]
    assert [b for b, _ in resumed.logical_batches()] == [b for b, _ in epoch2]
