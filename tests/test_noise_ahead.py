"""One process draws the next step's secure noise on a worker thread (veil.noise_ahead, veil.optimizer).

The rules are those of the distributed overlap (test_distributed_overlap.py), for the same buffer:
every step's noise is one fresh draw used once (the buffered draw is the one added, and never again);
a buffered draw of the wrong standard deviation or size is discarded; a seeded source, ``draw_ahead =
False`` and σ = 0 never draw ahead; nothing of the buffer is in a checkpoint; a draw made before a
fork is not used in the child. Deterministic apart from the noise itself (no statistical test here:
the noise's law is test_rng_secure_normal.py's).
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.engine import PrivacyEngine
from veil.mechanisms import SecureSource, SeededSource
from veil.noise_ahead import MIN_COORDINATES_AHEAD, NoiseAhead, worth_drawing_ahead
from veil.optimizer import release_grid

N, BATCH = 40, 8
KEY = (torch.float64, torch.device("cpu"))


def _private(
    secure: bool, sigma: float = 1.3, default_ahead: bool = False
) -> tuple[PrivacyEngine, nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(30, 20).to(torch.float64)
    data = TensorDataset(torch.randn(N, 30, dtype=torch.float64), torch.zeros(N, dtype=torch.long))
    engine = PrivacyEngine() if secure else PrivacyEngine(seed=0, reproducible=True)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
    )
    if not default_ahead:
        optimizer.draw_ahead = secure  # the default depends on the machine's free cores (tested below)
    return engine, model, optimizer, loader


def _noise_step(model: nn.Module, optimizer: Any, loader: Any) -> torch.Tensor:
    """One logical step whose every per-example gradient is 0: the gradients are the step's noise."""
    x, _ = next(iter(loader))
    optimizer.zero_grad()
    (model(x) * 0.0).sum().backward()
    optimizer.step()
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def _rounded(noise: torch.Tensor, std: float) -> torch.Tensor:
    grid = release_grid(std)
    return noise.div(grid).round().mul(grid)


def test_each_step_adds_the_draw_made_on_the_worker_thread_once() -> None:
    _, model, optimizer, loader = _private(secure=True)
    std = optimizer.noise_std / BATCH
    seen = [_noise_step(model, optimizer, loader)]  # step 1: nothing buffered yet
    assert optimizer.noise_draws == 2  # this step's draw, then the next step's, on the worker
    for step in range(2, 7):
        buffered = optimizer.noise_ahead.peek(KEY)[1].clone()
        noise = _noise_step(model, optimizer, loader)
        assert torch.equal(noise, _rounded(buffered, std)), step  # the buffered draw was the one added
        assert not torch.equal(optimizer.noise_ahead.peek(KEY)[1], buffered)  # ... and replaced
        assert optimizer.noise_draws == step + 1  # one draw per step (plus the one ahead)
        seen.append(noise)
    # no draw was added to two steps: two independent rounded draws agree on ~0.1 % of coordinates
    for i in range(len(seen)):
        for j in range(i):
            assert (seen[i] == seen[j]).double().mean() < 0.05, (i, j)


def test_a_buffered_draw_of_another_std_is_discarded() -> None:
    _, model, optimizer, loader = _private(secure=True)
    _noise_step(model, optimizer, loader)
    old = optimizer.noise_ahead.peek(KEY)[1].clone()
    optimizer.noise_multiplier = 2.6  # what the user (or adaptive clipping, through C) does between steps
    noise = _noise_step(model, optimizer, loader)
    assert not torch.equal(noise, _rounded(old, 1.3 / BATCH))
    assert not torch.equal(noise, _rounded(old, 2.6 / BATCH))
    assert optimizer.noise_draws == 4  # step 1 + ahead, then a fresh one (the old one dropped) + ahead
    assert optimizer.noise_ahead.peek(KEY)[0] == pytest.approx(2.6 / BATCH)


def test_a_buffered_draw_of_another_size_or_key_is_discarded() -> None:
    buffer = NoiseAhead(SecureSource())
    buffer.prepare(KEY, 10, 1.0, background=True)
    buffered = buffer.peek(KEY)[1].clone()
    fresh = buffer.take(KEY, 12, 1.0)  # the parameters changed size
    assert fresh.shape == (12,) and len(buffer) == 0 and buffer.draws == 2
    buffer.prepare(KEY, 10, 1.0, background=True)
    other = buffer.take((torch.float32, torch.device("cpu")), 10, 1.0)  # another group: not this draw
    assert other.dtype == torch.float32 and len(buffer) == 1
    taken = buffer.take(KEY, 10, 1.0)
    assert not torch.equal(taken, buffered) and len(buffer) == 0


@pytest.mark.parametrize("case", ["seeded", "switched off", "sigma 0"])
def test_no_draw_ahead_when_it_must_not_happen(case: str) -> None:
    """Seeded: its stream order is what makes a research run reproducible, so it never draws ahead."""
    _, model, optimizer, loader = _private(secure=case != "seeded", sigma=0.0 if case == "sigma 0" else 1.3)
    if case == "seeded":
        optimizer.draw_ahead = True  # even when asked: a seeded source is drawn at the step
    if case == "switched off":
        optimizer.draw_ahead = False
    for _ in range(4):
        _noise_step(model, optimizer, loader)
    assert len(optimizer.noise_ahead) == 0
    assert optimizer.noise_draws == (0 if case == "sigma 0" else 4)


def test_seeded_noise_is_the_stream_drawn_in_step_order() -> None:
    """Research mode adds exactly what its seeded stream gives at each step, as before draw-ahead."""
    engine, model, optimizer, loader = _private(secure=False)
    reference = SeededSource(engine.noise_source.seed)  # type: ignore[attr-defined]
    std = optimizer.noise_std / BATCH
    numel = sum(p.numel() for p in model.parameters())
    for _ in range(3):
        expected = reference.normal((numel,), std, dtype=torch.float64)
        assert torch.equal(_noise_step(model, optimizer, loader), _rounded(expected, std))


def test_the_buffered_draw_is_in_no_checkpoint() -> None:
    """Whoever reads a checkpoint (optimizer and engine state, as the training loop saves them) could
    otherwise subtract the next step's noise from its release."""
    engine, model, optimizer, loader = _private(secure=True)
    for _ in range(2):
        _noise_step(model, optimizer, loader)
    _, buffered = optimizer.noise_ahead.peek(KEY)
    needle = buffered[:16].contiguous().numpy().tobytes()  # 16 float64 noise values, 128 bytes

    def saved(obj: Any) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    assert needle in saved({"noise": buffered})  # the search finds a tensor saved by torch.save
    assert needle not in saved({"optimizer": optimizer.state_dict(), "engine": engine.state_dict()})


def test_a_draw_made_before_a_fork_is_not_used_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a forked child the parent's buffered draw is discarded (the parent may add it too), without
    waiting for a worker thread that does not exist there."""
    buffer = NoiseAhead(SecureSource())
    buffer.prepare(KEY, 64, 1.0, background=False)
    parent = buffer.peek(KEY)[1].clone()
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)  # as in a forked child
    child = buffer.take(KEY, 64, 1.0)
    assert not torch.equal(child, parent) and buffer.draws == 2


def test_a_failed_draw_ahead_fails_the_step_that_takes_it() -> None:
    class Broken(SecureSource):
        def normal(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise OSError("no entropy")

    buffer = NoiseAhead(Broken())
    buffer.prepare(KEY, 8, 1.0, background=True)
    with pytest.raises(OSError, match="no entropy"):
        buffer.take(KEY, 8, 1.0)


def test_drawing_ahead_is_the_default_where_a_core_or_device_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cores = torch.device("cpu"), len(os.sched_getaffinity(0))
    big = MIN_COORDINATES_AHEAD
    assert worth_drawing_ahead([torch.device("cuda", 0)])  # the host is free while the device computes
    assert worth_drawing_ahead([torch.device("cuda", 0)], big)
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert not worth_drawing_ahead([cpu])  # every core busy with the step: the thread would compete
    assert not worth_drawing_ahead([cpu], big)
    _, _, optimizer, _ = _private(secure=True, default_ahead=True)
    assert optimizer.draw_ahead is False
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
    assert worth_drawing_ahead([cpu]) == (cores > 1)
    assert worth_drawing_ahead([cpu], big) == (cores > 1)


def test_a_small_draw_is_made_at_the_step_even_with_a_free_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread a step costs more than a draw this small hides (see veil.noise_ahead): public sizes only.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert worth_drawing_ahead([torch.device("cpu")], MIN_COORDINATES_AHEAD)
    assert not worth_drawing_ahead([torch.device("cpu")], MIN_COORDINATES_AHEAD - 1)
    assert not worth_drawing_ahead([torch.device("cuda", 0)], MIN_COORDINATES_AHEAD - 1)
    _, _, optimizer, _ = _private(secure=True, default_ahead=True)  # 620 parameters
    assert optimizer.draw_ahead is False
