"""The distributed optimizer's overlap: the next step's secure noise slice is drawn while the all-reduce
is in flight (veil.data_parallel.optimizer). In one process, on a 1-rank gloo group (no spawn: fast).

What must hold: every step's noise is one fresh draw used once (the buffered draw is the one added, and
never again); a buffered draw of the wrong standard deviation is discarded; the seeded source and
``overlap_noise = False`` never draw ahead; σ = 0 draws nothing. The 2-rank guarantees with the overlap
on (noise std by χ², replicas bit-identical, σ = 0 equal to one process) are in test_distributed.py.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.engine import PrivacyEngine
from veil.optimizer import release_grid

N, BATCH = 40, 8


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init = Path(tmp_path_factory.mktemp("overlap")) / "rendezvous"
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _private(secure: bool, sigma: float = 1.3) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(30, 20).to(torch.float64)
    data = TensorDataset(torch.randn(N, 30, dtype=torch.float64), torch.zeros(N, dtype=torch.long))
    engine = PrivacyEngine() if secure else PrivacyEngine(seed=0, reproducible=True)
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        distributed=True,
    )


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


def test_each_step_adds_the_draw_made_during_the_previous_all_reduce_once(group: None) -> None:
    model, optimizer, loader = _private(secure=True)
    std = optimizer.noise_std / BATCH
    key = (torch.float64, torch.device("cpu"))
    seen: list[torch.Tensor] = [_noise_step(model, optimizer, loader)]  # step 1: nothing buffered yet
    assert optimizer.noise_draws == 2  # this step's draw, then the next step's, while in flight
    for step in range(2, 7):
        buffered = optimizer.noise_ahead.peek(key)[1].clone()
        noise = _noise_step(model, optimizer, loader)
        assert torch.equal(noise, _rounded(buffered, std)), step  # the buffered draw was the one added
        assert not torch.equal(optimizer.noise_ahead.peek(key)[1], buffered)  # ... and replaced by a new one
        assert optimizer.noise_draws == step + 1  # one draw per step (plus the one ahead)
        seen.append(noise)
    # no draw was added to two steps: two independent rounded draws agree on ~0.1 % of coordinates
    # (grid σ/256), a reused one on all of them
    for i in range(len(seen)):
        for j in range(i):
            assert (seen[i] == seen[j]).double().mean() < 0.05, (i, j)


def test_a_buffered_draw_of_another_std_is_discarded(group: None) -> None:
    model, optimizer, loader = _private(secure=True)
    key = (torch.float64, torch.device("cpu"))
    _noise_step(model, optimizer, loader)
    old = optimizer.noise_ahead.peek(key)[1].clone()
    optimizer.noise_multiplier = 2.6  # what adaptive clipping does to σΔ between steps
    noise = _noise_step(model, optimizer, loader)
    assert not torch.equal(noise, _rounded(old, 1.3 / BATCH))
    assert not torch.equal(noise, _rounded(old, 2.6 / BATCH))
    assert optimizer.noise_draws == 4  # step 1 + ahead, then a fresh one (the old one dropped) + ahead
    assert optimizer.noise_ahead.peek(key)[0] == pytest.approx(2.6 / BATCH)


@pytest.mark.parametrize("case", ["seeded", "switched off", "sigma 0"])
def test_no_draw_ahead_when_it_must_not_happen(group: None, case: str) -> None:
    """Seeded: its stream order reproduces the 1-process run and a resumed run, so it never draws ahead."""
    model, optimizer, loader = _private(secure=case != "seeded", sigma=0.0 if case == "sigma 0" else 1.3)
    if case == "switched off":
        optimizer.overlap_noise = False
    for _ in range(4):
        _noise_step(model, optimizer, loader)
    assert len(optimizer.noise_ahead) == 0
    assert optimizer.noise_draws == (0 if case == "sigma 0" else 4)
    assert optimizer.reductions == 4


def test_the_buffered_draw_is_not_in_a_checkpoint(group: None) -> None:
    """Nothing of the buffer is checkpointed: whoever reads the checkpoint (the optimizer's state, as
    the training loop saves it) could otherwise subtract the next step's noise from its release."""
    import io

    model, optimizer, loader = _private(secure=True)
    for _ in range(2):
        _noise_step(model, optimizer, loader)
    _, buffered = optimizer.noise_ahead.peek((torch.float64, torch.device("cpu")))
    needle = buffered[:16].contiguous().numpy().tobytes()  # 16 float64 noise values, 128 bytes

    def saved(obj: Any) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    assert needle in saved({"noise": buffered})  # the search finds a tensor saved by torch.save
    assert needle not in saved({"optimizer": optimizer.state_dict()})
