"""Adaptive clipping across 2 gloo ranks: one clip norm C on every rank, the count noised once.

The ranks' local counts of examples within C are all-reduced and the count's noise is drawn once
(rank 0 in the seeded mode, one rank in the secure mode), so every rank moves C identically, the
replicas stay bit-identical, a seeded 2-rank run reproduces the 1-process run, and the accountant
charges the planned step event. One spawn runs both modes; a deadlock fails after RUN_TIMEOUT_S.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.accounting.calibrate import dpsgd_event
from veil.clipping.adaptive import enable_adaptive_clipping
from veil.engine import PrivacyEngine

WORLD = 2
N, BATCH, STEPS, SIGMA, COUNT_STD = 40, 8, 12, 0.8, 2.0


def _train(*, distributed: bool, secure: bool) -> dict[str, Any]:
    """``STEPS`` logical steps with adaptive clipping from C = 0.05 (well below the median norm)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    )
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float64)
    engine = PrivacyEngine() if secure else PrivacyEngine(seed=0, reproducible=True)
    inner, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=0.05,
        distributed=distributed,
        criterion=nn.CrossEntropyLoss(),
    )
    hook = enable_adaptive_clipping(optimizer, target_quantile=0.5, count_std=COUNT_STD, lr=0.5)
    params: list[torch.Tensor] = []
    while len(params) < STEPS:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(inner(x), y).backward()
            optimizer.step()
            if optimizer.pending_chunks == 0:
                params.append(torch.cat([p.detach().reshape(-1).clone() for p in inner.parameters()]))
            if len(params) == STEPS:
                break
    assert engine.plan is not None
    return {
        "clips": [h["clip"] for h in hook.history],
        "shares": [h["released_share"] for h in hook.history],
        "params": params,
        "event": engine.plan.event,
        "steps": engine.steps,
        "epsilon": engine.get_epsilon(1e-5),
    }


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = {mode: _train(distributed=True, secure=mode == "secure") for mode in ("seeded", "secure")}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("adaptive")
    context = mp.start_processes(
        _rank_main, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 240
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("2-rank run did not finish within 240 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mode", ["seeded", "secure"])
def test_one_clip_norm_and_identical_replicas_on_every_rank(ranks: list[dict[str, Any]], mode: str) -> None:
    a, b = ranks[0][mode], ranks[1][mode]
    assert len(a["clips"]) == STEPS
    assert a["clips"] == b["clips"]  # bit-identical C after every step
    assert a["shares"] == b["shares"]
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(pa, pb), (step, (pa - pb).abs().max())
    assert a["clips"][-1] > 0.1  # C moved up from 0.05 towards the median norm: not vacuous


def test_two_ranks_reproduce_the_one_process_clip_and_model(ranks: list[dict[str, Any]]) -> None:
    """Seeded: the summed counts and rank 0's single count draw are what one process forms and draws
    (the same stream, in the same order), so C follows the same path; tolerance 1e-10 (float64, only
    the order of the gradient sums differs)."""
    reference = _train(distributed=False, secure=False)
    got = ranks[0]["seeded"]
    assert got["shares"] == pytest.approx(reference["shares"], rel=0, abs=1e-12)
    assert got["clips"] == pytest.approx(reference["clips"], rel=1e-10)
    assert torch.allclose(got["params"][-1], reference["params"][-1], rtol=0, atol=1e-10)


def test_accounting_is_the_planned_step_event(ranks: list[dict[str, Any]]) -> None:
    """The count is paid inside each step's event: the charge is the fixed-C plan's, on every rank."""
    reference = _train(distributed=False, secure=False)
    for r in range(WORLD):
        for mode in ("seeded", "secure"):
            got = ranks[r][mode]
            assert got["event"] == dpsgd_event(BATCH / N, SIGMA)
            assert got["steps"] == STEPS
            assert got["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
