"""A small secure float32 group's noise drawn for several steps at once (``NoiseAhead.reserved``).

Each step's release is its own row of one host draw, checked bit for bit against the independent
numpy reference on the same keystream words (test_host_release.py's); the rows are used once and in
order, and a reserve is refilled from fresh keys when its rows run out. A reserve that no longer fits
(another std, size or process) is never used, and a key whose std changed with rows left is drawn at
the step from then on. Adaptive clipping, an auditor that reads the clipped sums, a seeded source,
float64 and large groups never take a reserve. Deterministic apart from the noise itself (the law of
the noise is test_rng_secure_normal.py's: a reserve is one draw of the same transform).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from test_host_release import _recording_sums, _reference, _secure_mlp, _seeded_words
from veil import noise_ahead as noise_ahead_module
from veil import optimizer as optimizer_module
from veil.mechanisms import SecureSource, SeededSource, box_muller
from veil.noise_ahead import NoiseAhead
from veil.optimizer import release_grid

KEY32 = (torch.float32, torch.device("cpu"))
STEPS_A_DRAW = 3


def _recorded_step(
    model: nn.Module, optimizer: Any, loader: Any, captured: list[list[torch.Tensor]]
) -> tuple[np.ndarray, list[torch.Tensor]]:
    """One logical step of the lr-0 model: (the released gradients, the clipped sums they came from)."""
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    released = torch.cat([p.grad.reshape(-1) for p in optimizer.clipper.parameters]).numpy().copy()
    return released, captured[-1]


def _reserving_mlp(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, nn.Module, Any, Any, int, list[Any]]:
    """The secure lr-0 MLP, reserves of STEPS_A_DRAW rows, seeded keystream words (seeds 100, 101, …)."""
    engine, model, optimizer, loader = _secure_mlp(30, 20, 16, 8, sigma=1.3, clip=0.7)
    numel = sum(p.numel() for p in optimizer.clipper.parameters)
    monkeypatch.setattr(noise_ahead_module, "RESERVE_COORDINATES", STEPS_A_DRAW * numel + 5)
    seeds = iter(range(100, 200))
    monkeypatch.setattr(engine.noise_source, "_release_words", lambda device: _seeded_words(next(seeds)))
    return engine, model, optimizer, loader, numel, _recording_sums(monkeypatch, optimizer.clipper)


def _noise(words_seed: int, numel: int, std: float) -> np.ndarray:
    out = np.empty(numel, dtype=np.float32)
    box_muller.normal_from_words(out, _seeded_words(words_seed), std)
    return out


def test_each_step_releases_its_own_row_of_the_reserve_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, model, optimizer, loader, n, sums_seen = _reserving_mlp(monkeypatch)
    std = optimizer.noise_std / optimizer.expected_batch_size
    grid = release_grid(std)
    steps = 2 * STEPS_A_DRAW + 1  # two whole reserves and the first row of a third
    for step in range(steps):
        released, sums = _recorded_step(model, optimizer, loader, sums_seen)
        assert any(float(s.abs().max()) > 0 for s in sums)  # a real clipped sum
        draw, row = divmod(step, STEPS_A_DRAW)
        reserve = _noise(100 + draw, STEPS_A_DRAW * n, std)
        alpha = 1.0 / optimizer.expected_batch_size
        expected = _reference(reserve[row * n : (row + 1) * n], sums, alpha, grid)
        assert np.array_equal(released, expected), step
    assert optimizer.noise_draws == 3  # one release (fresh keys) per reserve
    assert engine.noise_source.release_keys == 0  # every word came from the patched keystream


def test_a_std_that_changes_with_rows_left_is_drawn_at_the_step_from_then_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """σ (or C, as adaptive clipping changes it) changed between steps: the reserve drawn at the old
    std is never used, and the key is drawn at the step afterwards (no reserve drawn per step)."""
    _, model, optimizer, loader, n, sums_seen = _reserving_mlp(monkeypatch)
    _recorded_step(model, optimizer, loader, sums_seen)  # reserve 100: its row 0
    optimizer.noise_multiplier = 2.6
    std = optimizer.noise_std / optimizer.expected_batch_size
    for step, seed in enumerate((101, 102, 103)):
        released, sums = _recorded_step(model, optimizer, loader, sums_seen)
        alpha = 1.0 / optimizer.expected_batch_size
        expected = _reference(_noise(seed, n, std), sums, alpha, release_grid(std))
        assert np.array_equal(released, expected), step  # one fresh draw of n at the new std
    assert optimizer.noise_draws == 4


def test_rows_are_handed_out_once_and_a_spent_reserve_is_drawn_again() -> None:
    buffer = NoiseAhead(SecureSource())
    numel = (noise_ahead_module.RESERVE_COORDINATES // 2) - 1  # two rows a reserve
    first = buffer.reserved(KEY32, numel, 1.0)
    second = buffer.reserved(KEY32, numel, 1.0)
    assert first is not None and second is not None and buffer.draws == 1
    assert not np.shares_memory(first, second) and not np.array_equal(first, second)
    third = buffer.reserved(KEY32, numel, 1.0)
    assert third is not None and buffer.draws == 2 and not np.shares_memory(third, second)


def test_a_reserve_made_before_a_fork_is_not_used_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = NoiseAhead(SecureSource())
    buffer.reserved(KEY32, 1000, 1.0)
    parent_next = buffer._reserves[KEY32].rows[1].copy()
    real = noise_ahead_module.os.getpid()
    monkeypatch.setattr(noise_ahead_module.os, "getpid", lambda: real + 1)  # as in a forked child
    child = buffer.reserved(KEY32, 1000, 1.0)
    assert child is not None and buffer.draws == 2 and not np.array_equal(child, parent_next)


@pytest.mark.parametrize(
    ("source", "key", "numel"),
    [
        (SeededSource(0), KEY32, 1000),
        (SecureSource(), (torch.float64, torch.device("cpu")), 1000),
        (SecureSource(), KEY32, (1 << 19) + 1),  # one row a reserve: nothing to gain
    ],
    ids=["seeded", "float64", "large"],
)
def test_no_reserve_where_it_does_not_apply(source: Any, key: Any, numel: int) -> None:
    buffer = NoiseAhead(source)
    assert buffer.reserved(key, numel, 1.0) is None and buffer.draws == 0


@pytest.mark.parametrize("case", ["auditor reads the sums", "adaptive clipping"])
def test_the_optimizer_takes_no_reserve_when_the_sums_are_read_or_the_std_moves(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _, model, optimizer, loader, _, sums_seen = _reserving_mlp(monkeypatch)

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a reserve was taken")

    monkeypatch.setattr(optimizer.noise_ahead, "reserved", refused)
    if case == "auditor reads the sums":
        optimizer.keep_clipped_sum = True
        _recorded_step(model, optimizer, loader, sums_seen)
    else:
        optimizer.adaptive = object()  # set by AdaptiveClipping: C, hence the std, moves every step
        sums = [torch.zeros(p.numel()) for p in optimizer.clipper.parameters]
        assert not optimizer._release_from_reserve(KEY32, sums, optimizer.noise_std, 1.0)


def test_a_failed_release_from_the_reserve_drops_the_accumulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """As for the release drawn at the step: a retried step must not release a partly written sum."""
    _, model, optimizer, loader, _, _ = _reserving_mlp(monkeypatch)
    real = optimizer_module.finisher

    def failing(sums: list[torch.Tensor], alpha: float, grid: float, *, into: bool = False) -> Any:
        finish = real(sums, alpha, grid, into=into)

        def run(out: np.ndarray, lo: int, hi: int) -> None:
            finish(out, lo, (lo + hi) // 2)  # half written over the sums, then a failure
            raise RuntimeError("boom")

        return run

    monkeypatch.setattr(optimizer_module, "finisher", failing)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step()
    assert all(bool((s == 0).all()) for s in optimizer.clipper.clipped_sum())
