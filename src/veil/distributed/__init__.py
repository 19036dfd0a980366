"""Data-parallel DP-SGD across processes and machines, on ``torch.distributed``.

    torch.distributed.init_process_group("gloo")            # torchrun / veil's launcher set the env
    model = DistributedDataParallel(net)                    # or pass net with distributed=True
    engine = veil.PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader, ...)
    # model is the inner module: train with it; loader yields this rank's shard of each logical batch

Guarantee (add/remove-one neighbouring, the same as one process with the same plan). Each logical
step releases ``(Σ_{i ∈ batch} clip_C(g_i) + N(0, σ²Δ²I)) / (q·N)`` to every rank, where the batch
is a Poisson(q) sample of the whole dataset of size N: each example is included with probability q,
decided once, by the rank that owns it (:mod:`veil.data_parallel.sampler`); the clipped sums are
all-reduced once per step and the noise enters once: each rank draws N(0, σ²C²) for its own slice
of the coordinates from OS entropy (secure, the default), or rank 0 draws it all (seeded research mode)
(:mod:`veil.data_parallel.optimizer`).
So the accountant's ``PoissonSampled(q, Gaussian(σ))`` per step holds whatever the world size.
Replicas start from rank 0's parameters and apply the same all-reduced update, so they stay
identical; every rank takes every logical step (an empty local batch contributes zeros).

Assumptions: every rank runs the same model and plan (checked), the same dataset in the same order
(its size is checked), and ranks write nothing that depends on private data except through rank 0's
ledger, checkpoints and report (:func:`is_writer`).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "DistributedDPOptimizer": "veil.data_parallel.optimizer",
    "DistributedSetup": "veil.data_parallel.setup",
    "ShardedPoissonBatchSampler": "veil.data_parallel.sampler",
    "is_writer": "veil.distributed.runtime",
    "owner_of": "veil.data_parallel.sampler",
    "rank_and_world": "veil.distributed.runtime",
    "resolve_setup": "veil.data_parallel.setup",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:  # torch loads only when a name is first used
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'veil.distributed' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
