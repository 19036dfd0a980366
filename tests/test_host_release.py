"""The DP release finished inside a secure host draw (veil.host_release): the same release as torch's ops.

Each chunk of the draw gets its slice of the clipped sum times 1/B and is rounded to the release grid on
the thread that drew it. Checked against an independent reference (the whole release spelled in numpy
on the same noise: equal bit for bit) and against the optimizer's torch ops (equal up to where torch
fuses the product into the addition: at most one grid step, on a rare coordinate), through the
finisher alone (chunks straddling parameter boundaries, in any order) and through a DP step whose
secure noise comes from known words (one piece, and three pieces on worker threads). Deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil import noise_ahead as noise_ahead_module
from veil import optimizer as optimizer_module
from veil.engine import PrivacyEngine
from veil.host_release import finisher
from veil.mechanisms import box_muller
from veil.mechanisms import rng as rng_module
from veil.optimizer import release_grid

SIZES = [7, 0, 300, 1, 64, 1000]


def _reference(noise: np.ndarray, sums: list[torch.Tensor], alpha: float, grid: float) -> np.ndarray:
    """``round((z + fl32(S·alpha)) / grid)·grid`` spelled out in float32 numpy, whole arrays at once."""
    s = np.concatenate([t.reshape(-1).numpy() for t in sums]).astype(np.float32)
    z = noise.astype(np.float32) + s * np.float32(alpha)
    return (np.rint(z / np.float32(grid)) * np.float32(grid)).astype(np.float32)


def _torch_release(noise: np.ndarray, sums: list[torch.Tensor], alpha: float, grid: float) -> np.ndarray:
    """The optimizer's torch ops (add with alpha, then div/round/mul) on the same noise."""
    flat = torch.from_numpy(noise.copy())
    for piece, s in zip(flat.split([t.numel() for t in sums]), sums, strict=True):
        piece.add_(s.reshape(-1), alpha=alpha)
    return flat.div_(grid).round_().mul_(grid).numpy()


def _close_to_torch(out: np.ndarray, torch_out: np.ndarray, grid: float) -> None:
    differ = out != torch_out
    assert np.all(np.abs(out[differ] - torch_out[differ]) <= grid * 1.0000001)
    assert differ.mean() < 1e-3


@pytest.mark.parametrize("order", ["in order", "reversed", "odd chunks"])
def test_finisher_equals_the_whole_release(order: str) -> None:
    gen = torch.Generator().manual_seed(3)
    sums = [torch.randn(n, generator=gen) * 4.0 for n in SIZES]
    n = sum(SIZES)
    noise = torch.randn(n, generator=gen).numpy() * 0.3
    alpha, grid = 1.0 / 7.0, release_grid(0.3)
    out = noise.copy()
    finish = finisher(sums, alpha, grid)
    assert finish is not None
    step = {"in order": 128, "reversed": 97, "odd chunks": 13}[order]
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    for lo, hi in reversed(chunks) if order == "reversed" else chunks:
        finish(out, lo, hi)
    assert np.array_equal(out, _reference(noise, sums, alpha, grid))
    assert np.array_equal(np.rint(out / np.float32(grid)) * np.float32(grid), out)  # on the grid
    _close_to_torch(out, _torch_release(noise, sums, alpha, grid), grid)


@pytest.mark.parametrize("order", ["in order", "reversed", "odd chunks"])
def test_finisher_into_the_sums_writes_the_same_release_over_them(order: str) -> None:
    """``into``: each chunk of noise comes in a buffer of its own (reused), and the release lands in
    the sums' memory: equal to the release the draw's own buffer gets."""
    gen = torch.Generator().manual_seed(5)
    sums = [torch.randn(n, generator=gen) * 4.0 for n in SIZES]
    before = [s.clone() for s in sums]
    n = sum(SIZES)
    noise = torch.randn(n, generator=gen).numpy() * 0.3
    alpha, grid = 1.0 / 7.0, release_grid(0.3)
    finish = finisher(sums, alpha, grid, into=True)
    assert finish is not None
    step = {"in order": 128, "reversed": 97, "odd chunks": 13}[order]
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    scratch = np.empty(step, dtype=np.float32)
    for lo, hi in reversed(chunks) if order == "reversed" else chunks:
        scratch[: hi - lo] = noise[lo:hi]
        finish(scratch[: hi - lo], lo, hi)
        scratch[:] = np.nan  # the chunk buffer is reused: nothing may be read from it later
    released = np.concatenate([s.reshape(-1).numpy() for s in sums])
    assert np.array_equal(released, _reference(noise, before, alpha, grid))


def test_finisher_into_refuses_a_non_contiguous_sum() -> None:
    assert finisher([torch.zeros(4, 3).T], 1.0, 0.5, into=True) is None


def test_finisher_into_refuses_sums_that_share_memory() -> None:
    shared = torch.zeros(10)
    assert finisher([shared[:5], shared[5:]], 1.0, 0.5, into=True) is None
    assert finisher([shared[:5], shared[5:]], 1.0, 0.5) is not None  # read only: fine
    assert finisher([torch.zeros(5), torch.zeros(0), torch.zeros(0)], 1.0, 0.5, into=True) is not None


def test_finisher_refuses_sums_it_cannot_read_as_float32() -> None:
    assert finisher([torch.zeros(3, dtype=torch.float64)], 0.5, 0.25) is None
    assert finisher([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)], 0.5, 0.25) is None


def test_a_non_contiguous_sum_is_read_in_its_flattened_order() -> None:
    sums = [torch.arange(12, dtype=torch.float32).reshape(4, 3).T]  # not contiguous
    out = np.zeros(12, dtype=np.float32)
    finish = finisher(sums, 1.0, 0.5)
    assert finish is not None
    finish(out, 0, 12)
    assert np.array_equal(out, sums[0].reshape(-1).numpy())


def test_a_grid_that_is_not_a_power_of_two_is_divided_not_multiplied() -> None:
    noise = np.linspace(-3.0, 3.0, 101, dtype=np.float32)
    out = noise.copy()
    finish = finisher([torch.zeros(101)], 1.0, 0.3)
    assert finish is not None
    finish(out, 0, 101)
    assert np.array_equal(out, np.rint(noise / np.float32(0.3)) * np.float32(0.3))


def _secure_mlp(
    features: int, hidden: int, rows: int, batch: int, *, sigma: float, clip: float
) -> tuple[PrivacyEngine, nn.Module, optimizer_module.DPOptimizer, DataLoader]:
    """A secure (default) private MLP on random rows, lr 0, noise drawn at the step (not ahead)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    data = TensorDataset(torch.randn(rows, features), torch.randint(0, 3, (rows,)))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
    )
    optimizer.draw_ahead = False
    return engine, model, optimizer, loader


def _watch_finisher(
    monkeypatch: pytest.MonkeyPatch, before_chunk: Callable[[list[torch.Tensor], bool, int, int], None]
) -> None:
    """The optimizer's finisher, calling ``before_chunk(sums, into, lo, hi)`` before each chunk."""
    real = optimizer_module.finisher

    def watched(sums: list[torch.Tensor], alpha: float, grid: float, *, into: bool = False) -> Callable:
        finish = real(sums, alpha, grid, into=into)
        assert finish is not None

        def run(out: np.ndarray, lo: int, hi: int) -> None:
            before_chunk(sums, into, lo, hi)
            finish(out, lo, hi)

        return run

    monkeypatch.setattr(optimizer_module, "finisher", watched)


def _recording_sums(monkeypatch: pytest.MonkeyPatch, clipper: Any) -> list[list[torch.Tensor]]:
    """A copy of the clipped sums of every release, appended as the optimizer reads them (before the
    release may be written over them)."""
    captured: list[list[torch.Tensor]] = []
    original = clipper.clipped_sum

    def recording() -> list[torch.Tensor]:
        sums = original()
        captured.append([s.clone() for s in sums])
        return sums

    monkeypatch.setattr(clipper, "clipped_sum", recording)
    return captured


def _seeded_words(seed: int) -> Callable[[int], np.ndarray]:
    gen = np.random.Generator(np.random.PCG64(seed))
    return lambda k: gen.integers(-(2**31), 2**31, size=k, dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("keep", [False, True], ids=["over the sums", "sums kept"])
@pytest.mark.parametrize("pieces", [1, 3])
def test_a_secure_step_releases_its_noise_plus_the_clipped_sum_on_the_grid(
    monkeypatch: pytest.MonkeyPatch, pieces: int, keep: bool
) -> None:
    """A default (secure) float32 step drawn at the step: its gradients are the release computed from
    the same keystream words by the reference, whether the draw is one piece or three on threads,
    and whether the release is written over the clipped sums (the default) or beside them (an
    auditor reads them: ``keep_clipped_sum``), which then still hold Σ clip(g_i)."""
    monkeypatch.setattr(noise_ahead_module, "RESERVE_COORDINATES", 0)  # drawn at the step (no reserve)
    engine, model, optimizer, loader = _secure_mlp(30, 20, 16, 8, sigma=1.3, clip=0.7)
    optimizer.keep_clipped_sum = keep
    if pieces > 1:
        monkeypatch.setattr(rng_module, "PARALLEL_PIECE", 100)
        monkeypatch.setattr(torch, "get_num_threads", lambda: pieces)
    seeds = iter(range(100, 200))
    source = engine.noise_source
    monkeypatch.setattr(source, "_release_words", lambda device: _seeded_words(next(seeds)))
    clipper = optimizer.clipper
    captured = _recording_sums(monkeypatch, clipper)
    finished: list[tuple[int, int]] = []

    kept: list[list[torch.Tensor]] = []

    def before_chunk(sums: list[torch.Tensor], into: bool, lo: int, hi: int) -> None:
        assert into is not keep
        if not finished:
            kept.append(sums)
        finished.append((lo, hi))

    _watch_finisher(monkeypatch, before_chunk)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    released = torch.cat([p.grad.reshape(-1) for p in clipper.parameters]).numpy()
    sums = captured[0]
    assert any(float(s.abs().max()) > 0 for s in sums)  # a real clipped sum, not zeros
    n = sum(s.numel() for s in sums)
    batch = optimizer.expected_batch_size
    std = optimizer.noise_std / batch
    noise = np.empty(n, dtype=np.float32)
    bounds = [n * i // pieces for i in range(pieces + 1)]
    for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        box_muller.normal_from_words(noise[lo:hi], _seeded_words(100 + j), std)
    grid = release_grid(std)
    assert grid == math.ldexp(1.0, math.floor(math.log2(std)) - 8)
    assert np.array_equal(released, _reference(noise, sums, 1.0 / batch, grid))
    _close_to_torch(released, _torch_release(noise, sums, 1.0 / batch, grid), grid)
    assert sorted(finished)[0][0] == 0 and len(finished) == pieces  # finished inside the draw, once
    assert all(a[1] == b[0] for a, b in zip(sorted(finished), sorted(finished)[1:], strict=False))
    assert sorted(finished)[-1][1] == n
    assert source.release_keys == 0  # every piece came from the patched words, none from a fresh key
    got = np.concatenate([t.reshape(-1).numpy() for t in kept[0]])
    assert np.array_equal(
        got, released if not keep else np.concatenate([t.reshape(-1).numpy() for t in sums])
    )


def test_a_release_into_the_sums_that_fails_midway_leaves_no_sum_to_release_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure after some chunks were written over the clipped sums drops the accumulator: a
    retried step releases noise on a zero sum, never a second release over the first (rev2's L1)."""
    monkeypatch.setattr(noise_ahead_module, "RESERVE_COORDINATES", 0)  # drawn at the step (no reserve)
    _, model, opt, loader = _secure_mlp(600, 500, 32, 16, sigma=1.0, clip=1.0)
    calls = [0]

    def before_chunk(sums: list[torch.Tensor], into: bool, lo: int, hi: int) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")

    _watch_finisher(monkeypatch, before_chunk)
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert calls[0] == 2  # the release was written over part of the sums before it failed
    assert all(bool((s == 0).all()) for s in opt.clipper.clipped_sum())
