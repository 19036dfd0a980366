"""Data-parallel DP-SGD across 2 gloo processes on CPU (veil.distributed).

One spawn of 2 ranks runs every scenario (spawning costs seconds on this machine); each test then
checks the results the ranks saved. The ranks share a file rendezvous in ``tmp_path``, their
collectives time out after 60 s, and the parent kills them if they have not finished in 240 s, so a
deadlock fails the run instead of hanging it.
"""

from __future__ import annotations

import datetime
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from veil.distributed import ShardedPoissonBatchSampler, is_writer, owner_of
from veil.engine import PrivacyEngine
from veil.errors import ConfigError, SamplingError
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.sampling import PoissonBatchSampler

WORLD = 2
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 240
N, BATCH, STEPS = 40, 8, 10


# ---------------------------------------------------------------------------------------------
# what every rank (and the 1-process reference) trains


def _data(n: int = N, features: int = 6) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, features, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )


def _mlp(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float64)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(
    model: nn.Module,
    *,
    sigma: float,
    steps: int,
    distributed: bool | None,
    physical_batch_size: int | None = None,
    data: TensorDataset | None = None,
    batch_size: int = BATCH,
    zero_loss: bool = False,
    save_to: Path | None = None,
    resume_from: Path | None = None,
    secure: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` logical steps; per step: the parameters, the gradients, the local batch size.

    ``resume_from``: load a checkpoint first; ``save_to``: the writer (rank 0) saves one at the end."""
    data = data if data is not None else _data()
    engine = PrivacyEngine() if secure else PrivacyEngine(seed=0, reproducible=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    inner, optimizer, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(data, batch_size=batch_size),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        physical_batch_size=physical_batch_size,
        distributed=distributed,
    )
    if resume_from is not None:
        state = torch.load(resume_from, weights_only=False)
        inner.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
    crit = nn.CrossEntropyLoss()
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    local_sizes: list[int] = []
    size = 0
    while len(params) < steps:
        for x, y in loader:
            optimizer.zero_grad()
            out = inner(x)
            loss = (out * 0.0).sum() if zero_loss else crit(out, y)
            loss.backward()
            optimizer.step()
            size += len(x)
            if optimizer.pending_chunks == 0:  # this physical batch closed a logical step
                params.append(_flat(inner))
                grads.append(torch.cat([p.grad.reshape(-1).clone() for p in inner.parameters()]))
                local_sizes.append(size)
                size = 0
            if len(params) == steps:
                break
    if save_to is not None and is_writer():
        state = {
            "model": inner.state_dict(),
            "optimizer": optimizer.state_dict(),
            "engine": engine.state_dict(),
        }
        torch.save(state, save_to)
    return {
        "params": params,
        "grads": grads,
        "local_sizes": local_sizes,
        "engine_steps": engine.steps,
        "reductions": getattr(optimizer, "reductions", None),
        "noise_draws": getattr(optimizer, "noise_draws", None),
        "epsilon": engine.get_epsilon(1e-5),
    }


# ---------------------------------------------------------------------------------------------
# the ranks


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        results: dict[str, Any] = {}
        # 1. DDP-wrapped, σ = 0, virtual batches of 3: the model must equal the 1-process one.
        ddp = DistributedDataParallel(_mlp(seed=1))
        comm_calls: list[int] = []

        def count_comm(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
            state.append(1)
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(comm_calls, count_comm)
        results["ddp"] = _train(ddp, sigma=0.0, steps=STEPS, distributed=None, physical_batch_size=3)
        results["ddp_comm_calls"] = len(comm_calls)
        try:
            ddp(torch.zeros(2, 6, dtype=torch.float64))
            results["ddp_forward_refused"] = False
        except ConfigError:
            results["ddp_forward_refused"] = True
        # 2. Plain module, distributed=True, rank 1 starts from other weights: broadcast; σ > 0.
        results["noisy"] = _train(_mlp(seed=1 + 100 * rank), sigma=0.8, steps=STEPS, distributed=True)
        # 3. Noise only (every per-example gradient is 0): the update is the noise / (q·N).
        wide = nn.Linear(30, 20).to(torch.float64)
        noise_data = TensorDataset(torch.randn(N, 30, dtype=torch.float64), torch.zeros(N, dtype=torch.long))
        results["noise"] = _train(wide, sigma=1.3, steps=8, distributed=True, data=noise_data, zero_loss=True)
        # ... and in secure mode, where each rank draws the noise of its slice of the coordinates.
        wide = nn.Linear(30, 20).to(torch.float64)
        results["noise_secure"] = _train(
            wide, sigma=1.3, steps=8, distributed=True, data=noise_data, zero_loss=True, secure=True
        )
        # 4. Tiny data: 8 examples, q = 0.25, 12 steps: many empty local batches.
        results["tiny"] = _train(_mlp(), sigma=1.0, steps=12, distributed=True, data=_data(n=8), batch_size=2)
        # 5. Checkpoint written by rank 0 after 3 steps, loaded by every rank: the same as 6 steps.
        results["whole"] = _train(_mlp(), sigma=0.8, steps=6, distributed=True)
        checkpoint = Path(out_dir) / "checkpoint.pt"
        _train(_mlp(), sigma=0.8, steps=3, distributed=True, save_to=checkpoint)
        dist.barrier()
        results["written_by"] = rank if checkpoint.exists() and rank == 0 else None
        results["resumed"] = _train(
            _mlp(seed=7), sigma=0.8, steps=3, distributed=True, resume_from=checkpoint
        )
        # 6. Refusals: a DistributedSampler loader, different plans across ranks.
        try:
            PrivacyEngine(seed=0, reproducible=True).make_private(
                module=_mlp(),
                optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1),
                data_loader=DataLoader(
                    _data(), batch_size=4, sampler=torch.utils.data.DistributedSampler(_data())
                ),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                distributed=True,
            )
            results["distributed_sampler_refused"] = False
        except SamplingError:
            results["distributed_sampler_refused"] = True
        try:
            model = _mlp()
            PrivacyEngine(seed=0, reproducible=True).make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=4 + rank),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                distributed=True,
            )
            results["plan_mismatch_refused"] = False
        except ConfigError:
            results["plan_mismatch_refused"] = True
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(tmp: Path) -> list[dict[str, Any]]:
    """Run ``_rank_main`` on 2 processes; kill them if they outlive RUN_TIMEOUT_S."""
    context = mp.start_processes(
        _rank_main, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"2-rank run did not finish within {RUN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("distributed"))


# ---------------------------------------------------------------------------------------------
# tests on the 2-rank run


def test_two_ranks_sigma_zero_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    """σ = 0, the same seed (so the union of local batches is the 1-process batch): same model.

    Tolerance: 1e-12 absolute in float64 after 10 steps of SGD with momentum; the only difference is
    the order in which the clipped sums are added (per rank, then across ranks)."""
    reference = _train(_mlp(seed=1), sigma=0.0, steps=STEPS, distributed=False)
    for r in range(WORLD):
        for step, (got, want) in enumerate(zip(ranks[r]["ddp"]["params"], reference["params"], strict=True)):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (r, step, (got - want).abs().max())
    # and the parameters moved, so the comparison is not vacuous
    assert not torch.allclose(reference["params"][-1], _flat(_mlp(seed=1)))
    # the local batches partition the 1-process batches
    sizes = [sum(s) for s in zip(*(ranks[r]["ddp"]["local_sizes"] for r in range(WORLD)), strict=True)]
    assert sizes == reference["local_sizes"]


def test_two_ranks_with_noise_equal_one_process_with_the_same_seed(ranks: list[dict[str, Any]]) -> None:
    """σ > 0: rank 0 draws the noise from the stream a 1-process run with that seed would use, once."""
    reference = _train(_mlp(seed=1), sigma=0.8, steps=STEPS, distributed=False)
    for r in range(WORLD):
        got = torch.stack(ranks[r]["noisy"]["params"])
        assert torch.allclose(got, torch.stack(reference["params"]), rtol=0, atol=1e-12)
    assert ranks[0]["noisy"]["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)


@pytest.mark.parametrize("case", ["ddp", "noisy", "noise", "noise_secure", "tiny"])
def test_replicas_bit_identical_after_every_step(ranks: list[dict[str, Any]], case: str) -> None:
    """Including the "noisy" case, where rank 1 started from different weights (broadcast at start)."""
    a, b = ranks[0][case], ranks[1][case]
    assert len(a["params"]) == len(b["params"]) > 0
    for pa, pb in zip(a["params"], b["params"], strict=True):
        assert torch.equal(pa, pb)


def test_ddp_never_averages_gradients(ranks: list[dict[str, Any]]) -> None:
    for r in range(WORLD):
        assert ranks[r]["ddp_comm_calls"] == 0  # DDP's reducer never ran
        assert ranks[r]["ddp_forward_refused"]  # a training forward through the wrapper is refused
        assert ranks[r]["ddp"]["reductions"] == STEPS  # one all-reduce of the clipped sums per step


def _chi2_accepts(samples: np.ndarray, std: float, false_failure: float) -> bool:
    """Two-sided χ² test of "i.i.d. N(0, std²)" on Σ x²/std² ~ χ²(n)."""
    n = samples.size
    statistic = float(np.sum((samples / std) ** 2))
    low, high = stats.chi2.ppf([false_failure / 2, 1 - false_failure / 2], n)
    return bool(low <= statistic <= high)


@pytest.mark.parametrize("case", ["noise", "noise_secure"])
def test_update_noise_std_is_sigma_c_over_global_batch(ranks: list[dict[str, Any]], case: str) -> None:
    """Every per-example gradient is 0, so p.grad after a step is the step's noise alone.

    "noise": seeded, rank 0 draws it all; "noise_secure": each rank draws its slice from OS entropy.
    Expected std σC/(qN) = 1.3·1.0/8. False-failure rate 1e-6 per case (two-sided χ² on 8 × 620 draws).
    The same samples are rejected at the wrong scales a broken implementation would give: 2× (dividing
    by the local q·N/W, or full noise from both ranks with the same seed), √2× (full noise from both
    ranks, independent), 1/√2× (one rank's slice left without noise) and ½×."""
    grads = ranks[0][case]["grads"]
    samples = torch.cat(grads).numpy()
    assert samples.size == 8 * 620
    expected = 1.3 * 1.0 / BATCH
    alpha = 1e-6
    assert _chi2_accepts(samples, expected, alpha)
    for wrong in (2.0, math.sqrt(2.0), math.sqrt(0.5), 0.5):
        assert not _chi2_accepts(samples, wrong * expected, alpha), wrong
    # the steps' noise draws are independent (not one draw repeated)
    assert not torch.equal(grads[0], grads[1])


def test_noise_drawn_once_per_step_on_the_ranks_that_draw_it(ranks: list[dict[str, Any]]) -> None:
    """Seeded: rank 0 draws every step's noise, rank 1 none. Secure: each rank draws its slice once per
    step, the next step's while the all-reduce is in flight (so one more than the 8 steps)."""
    assert [ranks[r]["noise"]["noise_draws"] for r in range(WORLD)] == [8, 0]
    assert [ranks[r]["noise_secure"]["noise_draws"] for r in range(WORLD)] == [9, 9]


def test_tiny_data_with_empty_local_batches_finishes(ranks: list[dict[str, Any]]) -> None:
    """8 examples, q = 0.25, 2 ranks, 12 steps: each rank's local batch is empty with probability
    0.75⁴ ≈ 0.32, yet every rank takes every step (bounded: the run finished within RUN_TIMEOUT_S)."""
    for r in range(WORLD):
        tiny = ranks[r]["tiny"]
        assert tiny["engine_steps"] == tiny["reductions"] == 12
    empties = sum(s == 0 for r in range(WORLD) for s in ranks[r]["tiny"]["local_sizes"])
    assert empties >= 1


def test_checkpoint_by_rank_0_resumes_every_rank_exactly(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 alone writes; every rank loads it; in research mode the resumed run is bit-identical."""
    assert ranks[0]["written_by"] == 0
    for r in range(WORLD):
        assert torch.equal(ranks[r]["resumed"]["params"][-1], ranks[r]["whole"]["params"][-1])
        assert ranks[r]["resumed"]["engine_steps"] == 6  # the ledger continued: 3 saved + 3 new


def test_refusals_across_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in range(WORLD):
        assert ranks[r]["distributed_sampler_refused"]
        assert ranks[r]["plan_mismatch_refused"]  # every rank refuses, not only the odd one


# ---------------------------------------------------------------------------------------------
# in one process: the sharded sampler and the refusals that need no process group


def test_sharded_batches_partition_the_one_process_batch() -> None:
    """Same seed on every rank: the local batches are disjoint, owned, and union to the 1-process batch."""
    n, q, steps = 101, 0.3, 20
    single = list(ShardedPoissonBatchSampler(n, q, steps, SeededSource(7), rank=0, world_size=1))
    for world in (2, 3):
        shards = [
            list(ShardedPoissonBatchSampler(n, q, steps, SeededSource(7), rank=r, world_size=world))
            for r in range(world)
        ]
        for k in range(steps):
            locals_ = [shards[r][k] for r in range(world)]
            assert all(owner_of(i, world) == r for r, batch in enumerate(locals_) for i in batch)
            assert sorted(i for batch in locals_ for i in batch) == sorted(single[k])


def test_each_example_is_one_bernoulli_q_across_ranks() -> None:
    """Independent secure sources per rank: inclusion counts per example and step are 0 or 1, and the
    number of inclusions over S steps is Binomial(S, q) per example. Tested on the total over all
    examples (Binomial(N·S, q)), two-sided at false-failure rate 1e-6, and per-example counts by a χ²
    goodness-of-fit against Binomial(S, q) (false-failure rate 1e-6)."""
    n, q, steps, world = 60, 0.25, 400, 2
    counts = np.zeros((steps, n), dtype=int)
    for r in range(world):
        sampler = ShardedPoissonBatchSampler(n, q, steps, SecureSource(), rank=r, world_size=world)
        for k, batch in enumerate(sampler):
            counts[k, batch] += 1
    assert counts.max() <= 1  # exactly one decision per example and step
    total = int(counts.sum())
    assert stats.binomtest(total, n * steps, q).pvalue > 1e-6
    per_example = counts.sum(axis=0)
    # χ² on binned per-example totals vs Binomial(steps, q)
    edges = np.array([-0.5, 89.5, 94.5, 99.5, 104.5, 109.5, steps + 0.5])
    observed, _ = np.histogram(per_example, bins=edges)
    cdf = stats.binom.cdf(np.floor(edges[1:]).astype(int), steps, q)
    expected = np.diff(np.concatenate([[0.0], cdf])) * n
    assert stats.chisquare(observed, expected).pvalue > 1e-6
    # ranks that each sampled the whole dataset (no sharding) would double-count: caught by the first check
    doubled = np.zeros_like(counts)
    for _ in range(world):
        for k, batch in enumerate(PoissonBatchSampler(n, q, steps, SecureSource())):
            doubled[k, batch] += 1
    assert doubled.max() == 2


def test_sampler_rank_is_checked() -> None:
    from veil.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="rank"):
        ShardedPoissonBatchSampler(10, 0.5, 2, SeededSource(0), rank=2, world_size=2)


def test_distributed_without_process_group_is_refused() -> None:
    model = _mlp()
    with pytest.raises(ConfigError, match="init_process_group"):
        PrivacyEngine(seed=0, reproducible=True).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            distributed=True,
        )
