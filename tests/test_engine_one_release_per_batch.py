"""One release per logical batch drawn for it (revF's F1 and F7, :mod:`veil.optimizer`).

Each noisy step is accounted as its own ``PoissonSampled(q, Gaussian(σ))``: it must release a logical
batch drawn for it alone. A second ``step()`` on a batch already stepped on (an inner-steps loop) is
refused before any noise is drawn or anything is accounted; clipped chunks of a logical batch left
unreleased (a ``break`` mid-batch, a fresh ``iter(loader)``, a skipped step) are dropped, never released
with a later sample. The legitimate paths (physical chunks, empty batches) keep one release per batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.clipping.adaptive import enable_adaptive_clipping
from veil.engine import PrivacyEngine
from veil.errors import SamplingError

N, FEATURES, CLASSES = 60, 4, 3


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return x, y, torch.arange(N)


def _private(
    *,
    batch_size: int = 12,
    physical: int | None = None,
    sigma: float = 1.0,
    clip: float = 1.0,
    lr: float = 0.1,
) -> tuple[PrivacyEngine, nn.Module, Any, Any]:
    torch.manual_seed(1)
    model = nn.Linear(FEATURES, CLASSES).double()
    engine = PrivacyEngine(seed=0, reproducible=True)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(*_rows()), batch_size=batch_size),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        loss_reduction="sum",
        physical_batch_size=physical,
    )
    return engine, model, optimizer, loader


def _step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    optimizer.step()


def _gradient_sum(model: nn.Module, rows: list[int]) -> torch.Tensor:
    """Σ_i ∇ℓ_i of the weight over ``rows`` at the model's (unchanged) weights, unclipped."""
    x, y, _ = _rows()
    copy = nn.Linear(FEATURES, CLASSES).double()
    copy.load_state_dict({k: v.detach() for k, v in model.state_dict().items()})
    nn.functional.cross_entropy(copy(x[rows]), y[rows], reduction="sum").backward()
    assert copy.weight.grad is not None
    return copy.weight.grad


# -- F1: a second step on one batch --------------------------------------------------------------


def test_a_second_step_on_one_batch_is_refused_before_noise_or_accounting() -> None:
    """revF's a8: ``for batch: for _ in range(2): step()``. Without the refusal the engine counts two
    independent sampled steps where one sample was released twice (σ/√2: ε under-stated 2.5×)."""
    engine, model, optimizer, loader = _private()
    x, y, _ = next(iter(loader))
    _step(model, optimizer, x, y)
    assert engine.steps == 1
    draws, events = optimizer.noise_draws, len(engine.accountant.ledger.events)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SamplingError, match="second step"):
        _step(model, optimizer, x, y)
    assert engine.steps == 1 and len(engine.accountant.ledger.events) == events
    assert optimizer.noise_draws == draws
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_the_inner_steps_loop_takes_one_step_only() -> None:
    engine, model, optimizer, loader = _private()
    with pytest.raises(SamplingError):
        for x, y, _ in loader:
            for _ in range(2):  # two noisy steps on the same sampled batch
                _step(model, optimizer, x, y)
    assert engine.steps == 1


def test_a_step_before_any_batch_is_drawn_is_refused() -> None:
    engine, model, optimizer, _ = _private()
    x, y, _ = _rows()
    with pytest.raises(SamplingError, match="before the private loader"):
        _step(model, optimizer, x[:5], y[:5])
    assert engine.steps == 0 and optimizer.noise_draws == 0


def test_a_second_step_on_one_chunk_is_refused_and_leaves_nothing_stale() -> None:
    """With physical chunks a repeated chunk would enter the sum twice (2C): refused at its second
    step. After the refusal is caught, the next logical batch's release holds its own rows only."""
    engine, model, optimizer, loader = _private(physical=3, sigma=0.0, clip=1e6, lr=0.0)
    iterator = iter(loader)
    x, y, _ = next(iterator)
    while loader.signal.last_chunk:  # a logical batch of one chunk cannot show the repeat mid-batch
        _step(model, optimizer, x, y)
        x, y, _ = next(iterator)
    _step(model, optimizer, x, y)
    with pytest.raises(SamplingError):
        _step(model, optimizer, x, y)
    assert optimizer.pending_chunks == 0
    assert all(bool((s == 0).all()) for s in optimizer.clipper.clipped_sum())
    steps = engine.steps
    rows = _rest_of_batch_then_one_batch(model, optimizer, loader, iterator)
    assert engine.steps == steps + 2  # the refused batch's remaining chunks, then a whole batch
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad * 12, _gradient_sum(model, rows))


def _rest_of_batch_then_one_batch(model: nn.Module, optimizer: Any, loader: Any, iterator: Any) -> list[int]:
    """Step on the current logical batch's remaining chunks, then on one whole logical batch; the
    rows of that last batch."""
    for x, y, _ in iterator:
        _step(model, optimizer, x, y)
        if loader.signal.last_chunk:
            break
    return _one_logical_batch(model, optimizer, loader, iterator)


def _one_logical_batch(model: nn.Module, optimizer: Any, loader: Any, iterator: Any) -> list[int]:
    """Step on every chunk of the next logical batch; its rows."""
    rows: list[int] = []
    for x, y, i in iterator:
        rows += i.tolist()
        _step(model, optimizer, x, y)
        if loader.signal.last_chunk:
            return rows
    raise AssertionError("the epoch ended first")


# -- F7: chunks of an abandoned logical batch ------------------------------------------------------


@pytest.mark.parametrize("how", ["fresh iterator", "skipped chunks"])
def test_chunks_of_an_abandoned_logical_batch_are_never_released(how: str) -> None:
    """revF's a10 (σ = 0, no clipping, lr = 0, so the release is Σ∇/B exactly): one chunk of a logical
    batch is stepped on, the rest is abandoned (a fresh ``iter(loader)``, or its remaining chunks
    skipped); the next release sums the next logical batch's rows only, and counts one step."""
    engine, model, optimizer, loader = _private(batch_size=20, physical=4, sigma=0.0, clip=1e6, lr=0.0)
    iterator = iter(loader)
    x, y, _ = next(iterator)
    while loader.signal.last_chunk:  # a batch of one chunk: released whole, nothing to abandon
        _step(model, optimizer, x, y)
        x, y, _ = next(iterator)
    _step(model, optimizer, x, y)
    assert optimizer.pending_chunks == 1
    steps = engine.steps
    if how == "fresh iterator":
        iterator = iter(loader)
    else:
        for _ in iterator:  # the rest of the batch drawn, never stepped on (a `continue`)
            if loader.signal.last_chunk:
                break
    rows = _one_logical_batch(model, optimizer, loader, iterator)
    assert engine.steps == steps + 1
    assert model.weight.grad is not None
    torch.testing.assert_close(model.weight.grad * 20, _gradient_sum(model, rows))


def test_adaptive_clipping_counts_only_the_released_batch() -> None:
    """The noisy count of adaptive clipping is over the released logical batch's examples only."""
    _, model, optimizer, loader = _private(batch_size=20, physical=4)
    hook = enable_adaptive_clipping(optimizer, target_quantile=0.5)
    iterator = iter(loader)
    x, y, _ = next(iterator)
    while loader.signal.last_chunk:
        _step(model, optimizer, x, y)
        x, y, _ = next(iterator)
    _step(model, optimizer, x, y)
    assert len(hook.norms) == 1
    x, y, _ = next(iter(loader))  # a fresh iteration: a new logical batch
    _step(model, optimizer, x, y)
    assert len(hook.norms) == (0 if loader.signal.last_chunk else 1)


# -- the legitimate paths keep one release per logical batch ---------------------------------------


@pytest.mark.parametrize("physical", [None, 1, 5])
def test_one_step_per_chunk_releases_once_per_logical_batch(physical: int | None) -> None:
    """Over three epochs, with and without chunks, every logical batch (empty ones too: q = 0.05 over
    60 rows leaves a few empty) is released exactly once."""
    engine, model, optimizer, loader = _private(batch_size=3, physical=physical)
    batches = 0
    for _ in range(3):
        for x, y, _ in loader:
            _step(model, optimizer, x, y)
            batches += int(loader.signal.last_chunk)
    assert engine.steps == batches == 3 * math.ceil(N / 3)
