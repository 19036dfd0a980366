"""Privacy units in the engine: unit-level clipping, Poisson sampling of units, K rows per unit.

References are independent of the fast path: a naive per-unit loop in float64 (one autograd call per
row) for the clipped sum, and the Binomial(T, q) law for unit inclusions (seeded Pearson chi-square
tests; each would fail by chance with probability ≤ 1e-3, and each is shown to reject 1.1·q).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import veil
from veil.clipping import PerSampleClipper
from veil.errors import InvalidParameterError, SamplingError
from veil.mechanisms.rng import make_source
from veil.units import UnitPoissonSampler, default_max_rows_per_unit, group_rows

ALPHA = 1e-3  # false-failure rate of each seeded chi-square test below


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()


def _naive_unit_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, units: list[int], c: float
) -> list[torch.Tensor]:
    """Σ_u clip_C(mean of unit u's per-row gradients), one autograd call per row (float64)."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for u in sorted(set(units)):
        rows = [i for i, v in enumerate(units) if v == u]
        mean = [torch.zeros_like(p) for p in params]
        for r in rows:
            loss = nn.functional.cross_entropy(model(x[r : r + 1]), y[r : r + 1])
            for m, g in zip(mean, torch.autograd.grad(loss, params), strict=True):
                m += g / len(rows)
        norm = math.sqrt(sum(float(m.square().sum()) for m in mean))
        factor = min(1.0, c / (norm + 1e-12))
        for t, m in zip(total, mean, strict=True):
            t += factor * m
    return total


def _clipped_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, units: list[int], c: float
) -> list[torch.Tensor]:
    clipper = PerSampleClipper(model, c)
    try:
        clipper.unit_index = torch.tensor(units, dtype=torch.long)
        nn.functional.cross_entropy(model(x), y).backward()
        clipper.accumulate()
        return [t.clone() for t in clipper.clipped_sum()]
    finally:
        clipper.remove()


def _units_of_sizes(k: int, count: int, rng: np.random.Generator) -> list[int]:
    sizes = rng.integers(1, k + 1, size=count)
    units = [u for u, n in enumerate(sizes) for _ in range(n)]
    return [units[i] for i in rng.permutation(len(units))]  # a unit's rows need not be consecutive


@pytest.mark.parametrize("k", [1, 3, 8])
def test_unit_clipped_sum_matches_naive_per_unit_loop(k: int) -> None:
    rng = np.random.default_rng(k)
    units = _units_of_sizes(k, 6, rng)
    x = torch.from_numpy(rng.normal(size=(len(units), 4)) * 3)
    y = torch.from_numpy(rng.integers(0, 3, size=len(units)))
    model = _model()
    fast = _clipped_sum(model, x, y, units, 0.3)
    naive = _naive_unit_sum(model, x, y, units, 0.3)
    for a, b in zip(fast, naive, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_adding_or_removing_one_unit_moves_the_sum_by_at_most_c(k: int) -> None:
    """Large, aligned gradients (inputs ×50): clipping each row would let a unit move the sum by K·C."""
    c = 0.5
    rng = np.random.default_rng(10 + k)
    units = sorted(_units_of_sizes(k, 5, rng))
    units[-k:] = [99] * k  # one unit with exactly K rows, all alike
    x = torch.from_numpy(rng.normal(size=(len(units), 4)) * 50)
    x[-k:] = x[-1]
    y = torch.from_numpy(rng.integers(0, 3, size=len(units)))
    model = _model()
    relabel = {u: i for i, u in enumerate(sorted(set(units)))}
    labels = [relabel[u] for u in units]
    with_unit = _clipped_sum(model, x, y, labels, c)
    keep = [i for i, u in enumerate(units) if u != 99]
    without = _clipped_sum(model, x[keep], y[keep], [labels[i] for i in keep], c)
    moved = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(with_unit, without, strict=True)))
    assert moved <= c * (1 + 1e-9)
    naive = _naive_unit_sum(model, x, y, labels, c)
    naive_without = _naive_unit_sum(model, x[keep], y[keep], [labels[i] for i in keep], c)
    for a, b in zip(with_unit, naive, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for a, b in zip(without, naive_without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def _histogram_p_value(counts: np.ndarray, trials: int, q: float) -> float:
    """Pearson chi-square of per-unit counts against Binomial(trials, q), bins pooled to ≥ 5 expected."""
    pmf = stats.binom.pmf(np.arange(trials + 1), trials, q) * len(counts)
    observed = np.bincount(counts, minlength=trials + 1).astype(float)
    edges, acc = [], 0.0
    for i, e in enumerate(pmf):
        acc += e
        if acc >= 5:
            edges.append(i)
            acc = 0.0
    edges[-1] = trials
    exp_bins, obs_bins, start = [], [], 0
    for e in edges:
        exp_bins.append(pmf[start : e + 1].sum())
        obs_bins.append(observed[start : e + 1].sum())
        start = e + 1
    exp_arr = np.array(exp_bins) * (len(counts) / np.sum(exp_bins))
    return float(stats.chisquare(obs_bins, exp_arr).pvalue)


def _inclusions(rate: float, units: int, steps: int, seed: int) -> np.ndarray:
    rows = group_rows(np.repeat(np.arange(units), 3))
    sampler = UnitPoissonSampler(rows, rate, steps, make_source(False, seed), max_rows_per_unit=2)
    counts = np.zeros(units, dtype=np.int64)
    for batch in sampler:
        counts[sorted({r // 3 for r in batch})] += 1
    return counts


def test_unit_inclusions_are_binomial_and_a_wrong_rate_is_rejected() -> None:
    q, units, steps = 0.1, 2000, 100
    assert _histogram_p_value(_inclusions(q, units, steps, seed=1), steps, q) > ALPHA
    assert _histogram_p_value(_inclusions(1.1 * q, units, steps, seed=1), steps, q) < ALPHA


def _engine_unit_inclusions(
    units: int, rows_per_unit: int, batch: int, epochs: int
) -> tuple[np.ndarray, int]:
    ids = np.repeat(np.arange(units), rows_per_unit)
    x = torch.arange(len(ids), dtype=torch.float32).unsqueeze(1)
    data = TensorDataset(x, torch.zeros(len(ids), dtype=torch.long))
    model = nn.Linear(1, 2)
    engine = veil.PrivacyEngine(reproducible=True, seed=3)
    _, _, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch),
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        unit_ids=[f"patient-{u}" for u in ids],
        max_rows_per_unit=2,
    )
    counts = np.zeros(units, dtype=np.int64)
    steps = 0
    for _ in range(epochs):
        for xb, _ in loader:
            seen = xb.squeeze(1).long().numpy() // rows_per_unit
            assert all(np.bincount(seen) <= 2)  # at most K rows of a unit per step
            counts[np.unique(seen)] += 1
            steps += 1
    return counts, steps


def test_engine_samples_units_at_batch_over_units() -> None:
    """q = B_units / N_units (not B / N_rows, which would be 4× smaller here)."""
    counts, steps = _engine_unit_inclusions(units=500, rows_per_unit=4, batch=50, epochs=10)
    assert steps == 100
    assert _histogram_p_value(counts, steps, 0.1) > ALPHA
    assert _histogram_p_value(counts, steps, 0.1 / 1.1) < ALPHA  # the same counts reject a rate 10 % off


def test_units_over_k_rows_contribute_a_uniform_k_subset() -> None:
    rows = group_rows([0] * 6 + [1])
    sampler = UnitPoissonSampler(rows, 1.0, 3000, make_source(False, 5), max_rows_per_unit=2)
    picks = np.zeros(7, dtype=np.int64)
    for batch in sampler:
        assert len(batch) == 3 and getattr(batch, "units", None) == [0, 0, 1]
        picks[batch] += 1
    assert picks[6] == 3000  # a unit under K contributes all its rows
    assert stats.chisquare(picks[:6]).pvalue > ALPHA  # each of 6 rows chosen with probability 2/6


def test_engine_plan_and_event_count_units() -> None:
    ids = np.repeat(np.arange(40), 5)
    data = TensorDataset(torch.randn(len(ids), 3), torch.zeros(len(ids), dtype=torch.long))
    model = nn.Linear(3, 2)
    engine = veil.PrivacyEngine()
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        unit_ids=ids,
    )
    assert engine.plan is not None
    assert engine.plan.privacy_unit == "unit" and engine.plan.dataset_size == 40
    assert engine.plan.sampling_rate == pytest.approx(8 / 40)
    assert engine.plan.max_rows_per_unit == default_max_rows_per_unit(8) == 16


def test_engine_step_equals_naive_unit_sum_across_physical_chunks() -> None:
    """One logical step in chunks of whole units: the accumulated sum is the per-unit reference."""
    ids = np.repeat(np.arange(30), 3)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(len(ids), 4)) * 3)
    y = torch.from_numpy(rng.integers(0, 3, size=len(ids)))
    model = _model()
    engine = veil.PrivacyEngine(reproducible=True, seed=1)
    _, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(torch.arange(len(ids)), y), batch_size=30),
        max_grad_norm=0.4,
        noise_multiplier=0.0,
        unit_ids=ids,
        max_rows_per_unit=3,
        physical_batch_size=7,
    )
    chunks = []
    for idx, yb in loader:
        assert len(idx) <= 7 and len(idx) % 3 == 0  # whole units only
        chunks.append(idx)
        nn.functional.cross_entropy(model(x[idx]), yb).backward()
        optimizer.step()
        if loader.signal.last_chunk:
            break
    rows = torch.cat(chunks)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optimizer.clipper.remove()
    naive = _naive_unit_sum(model, x[rows], y[rows], (rows // 3).tolist(), 0.4)
    for g, n in zip(grads, naive, strict=True):
        torch.testing.assert_close(g, n / 30, rtol=1e-9, atol=1e-12)


def test_unit_requests_are_refused_before_anything_changes() -> None:
    data = TensorDataset(torch.randn(10, 3), torch.zeros(10, dtype=torch.long))

    def attempt(**kwargs: object) -> None:
        model = nn.Linear(3, 2)
        veil.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            **kwargs,
        )

    with pytest.raises(InvalidParameterError, match="max_rows_per_unit"):
        attempt(unit_ids=list(range(10)), max_rows_per_unit=0)
    with pytest.raises(InvalidParameterError, match="unit_ids"):
        attempt(unit_ids=list(range(9)))
    with pytest.raises(InvalidParameterError, match="max_rows_per_unit"):
        attempt(max_rows_per_unit=2)
    with pytest.raises(SamplingError, match="unit_ids"):
        attempt(unit_ids=list(range(10)), poisson_sampling=False, allow_non_poisson=True)
    with pytest.raises(SamplingError, match="batch_size"):
        attempt(unit_ids=[0] * 10)  # 1 unit, 2 expected per step: q > 1


def test_a_unit_engine_state_resumes_and_a_row_state_is_refused() -> None:
    """The plan (unit, K, q over units) is part of the saved state: a resume must match it."""
    from veil.errors import CheckpointError

    ids = np.repeat(np.arange(20), 3)
    data = TensorDataset(torch.randn(len(ids), 3), torch.zeros(len(ids), dtype=torch.long))

    def engine_for(**kwargs: object) -> veil.PrivacyEngine:
        model = nn.Linear(3, 2)
        engine = veil.PrivacyEngine(reproducible=True, seed=4)
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4),
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            **kwargs,
        )
        return engine

    saved = engine_for(unit_ids=ids, max_rows_per_unit=2).state_dict()
    assert saved["plan"]["privacy_unit"] == "unit" and saved["plan"]["dataset_size"] == 20
    engine_for(unit_ids=ids, max_rows_per_unit=2).load_state_dict(saved)
    with pytest.raises(CheckpointError):
        engine_for(unit_ids=ids, max_rows_per_unit=3).load_state_dict(saved)
    with pytest.raises(CheckpointError):
        engine_for().load_state_dict(saved)
