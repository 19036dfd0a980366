"""Data-parallel DP-SGD across processes and machines, on ``torch.distributed``.

    torch.distributed.init_process_group("gloo")            # torchrun / veil's launcher set the env
    model = DistributedDataParallel(net)                    # or pass net with distributed=True
    engine = veil.PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader, ...)
    # model is the inner module: train with it; loader yields this rank's shard of each logical batch

Guarantee (add/remove-one neighbouring, the same as one process with the same plan). Each logical
step releases ``(Σ_{i ∈ batch} clip_C(g_i) + N(0, σ²Δ²I)) / (q·N)`` to every rank, where the batch
is a Poisson(q) sample of the whole dataset of size N: each example is included with probability q,
decided once, by the rank that owns it (:mod:`veil.distributed.sampler`); the clipped sums are
all-reduced once per step and the noise is drawn once, by rank 0 (:mod:`veil.distributed.optimizer`).
So the accountant's ``PoissonSampled(q, Gaussian(σ))`` per step holds whatever the world size.
Replicas start from rank 0's parameters and apply the same all-reduced update, so they stay
identical; every rank takes every logical step (an empty local batch contributes zeros).

Assumptions: every rank runs the same model and plan (checked), the same dataset in the same order
(its size is checked), and ranks write nothing that depends on private data except through rank 0's
ledger, checkpoints and report (:func:`is_writer`).
"""

from __future__ import annotations

from veil.distributed.optimizer import DistributedDPOptimizer
from veil.distributed.runtime import is_writer, rank_and_world
from veil.distributed.sampler import ShardedPoissonBatchSampler, owner_of
from veil.distributed.setup import DistributedSetup, resolve_setup

__all__ = [
    "DistributedDPOptimizer",
    "DistributedSetup",
    "ShardedPoissonBatchSampler",
    "is_writer",
    "owner_of",
    "rank_and_world",
    "resolve_setup",
]
