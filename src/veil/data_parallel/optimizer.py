"""The DP optimizer across ranks: local clipped sums, one all-reduce, noise added once, global divisor.

Guarantee (per logical step, add/remove-one neighbouring, the same release as one process). Every rank
holds the clipped sum ``S_r = Σ_{i ∈ local batch of r} clip_C(g_i)`` of its own local batch. One
``all_reduce(SUM)`` per step (one per parameter dtype/device group, normally exactly one) gives every
rank

    ḡ = (Σ_r S_r + Z) / B,        Z ~ N(0, σ²Δ²·I),  B = q·N (the global expected batch size),

where ``Z`` enters exactly once, in one of two ways fixed by the noise source:

* secure source (OS CSPRNG, the default): the coordinates are cut into W contiguous slices and rank
  ``r`` draws ``N(0, σ²Δ²)`` for slice ``r`` only (zeros elsewhere), from its own OS entropy, before
  the reduction; each coordinate thus gets exactly one independent draw, so the summed noise is
  ``N(0, σ²Δ²·I)``, and each rank draws only 1/W of it (secure draws are costly);
* seeded source (research mode): rank 0 alone draws ``Z`` from its generator, the stream a single
  process with that seed would use; the other ranks add none, so ranks with identically seeded
  generators can never add correlated copies.

Because
the local batches partition a Poisson sample of the whole dataset
(:class:`~veil.data_parallel.sampler.ShardedPoissonBatchSampler`), ``Σ_r S_r`` is the clipped sum one
process would form, with sensitivity ``Δ``; the divisor is the constant global ``B``, never a local or
realised batch size. Ranks then apply the same update from the same all-reduced bytes, so replicas
stay identical.

Overlap (secure source only). The all-reduce is started asynchronously; while it is in flight —
time a rank otherwise spends waiting for its peers and for the transport — the rank draws its noise
slice for the *next* step (same shape, same standard deviation, same dtype and device), and the next
step adds that draw instead of drawing one then. The draw is independent of all data and is kept in
the single-process optimizer's buffer, :class:`~veil.noise_ahead.NoiseAhead`, under its rules: used
for exactly one step, discarded when its standard deviation or size no longer matches (adaptive
clipping changed C), never checkpointed, never carried into a forked child, never drawn from a
seeded source (whose stream order is what lets a 2-rank run reproduce the 1-process run and a
resumed run reproduce an uninterrupted one). Here the draw is made on the calling thread during the
all-reduce, not on a worker thread after the step. Why no per-layer buckets: on gloo several
concurrent all-reduces of the pieces cost more than one of the whole buffer (measured in
``docs/distributed.md``), so each step reduces one flat buffer per parameter dtype/device group.

Assumptions: every rank calls ``step()`` once per physical batch and the logical steps line up (the
sharded sampler gives every rank ``steps_per_epoch`` logical batches, empty ones included); the
collective's result is the same on every rank (true of gloo's and NCCL's all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from veil.optimizer import DPOptimizer, release_grid

__all__ = ["DistributedDPOptimizer"]


class DistributedDPOptimizer(DPOptimizer):
    """:class:`~veil.optimizer.DPOptimizer` whose logical step all-reduces the clipped sums (see module)."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self.rank = int(rank)  # rank within ``group``
        self.world_size = int(world_size)
        self.group = group
        self.reductions = 0  # all-reduce calls made, for tests and logs
        # Draw the next step's noise slice while the all-reduce is in flight (secure source only),
        # instead of on a worker thread after the step as one process does.
        self.overlap_noise = True
        self.draw_ahead = False

    @property
    def shares_noise(self) -> bool:
        """True when each rank draws one slice of the noise (secure source); False: rank 0 draws it all."""
        return bool(self._noise.secure)

    def noise_slice(self, numel: int) -> tuple[int, int]:
        """The coordinates ``[lo, hi)`` of a group of ``numel`` whose noise this rank draws."""
        if not self.shares_noise:
            return (0, numel) if self.rank == 0 else (0, 0)
        return numel * self.rank // self.world_size, numel * (self.rank + 1) // self.world_size

    @torch.no_grad()
    def noisy_count(self, centred: float, std: float) -> float:
        """Adaptive clipping's count over the whole logical batch: ``Σ_r centred_r + N(0, std²)``.

        One all-reduce of (this rank's centred count, its share of the noise); the noise is drawn
        once, by the rank that draws a one-coordinate group's noise (:meth:`noise_slice`: rank 0 on a
        seeded source, in the stream order one process uses; one rank's OS entropy on a secure one).
        Every rank gets the same float64 sum, so every rank moves C identically. The centred counts
        are half-integers, so their sum is exact and is added to the noise after the reduction, as
        one process adds them.
        """
        lo, hi = self.noise_slice(1)
        noise = float(self._noise.normal((1,), std, dtype=torch.float64)[0]) if hi > lo else 0.0
        device = self.clipper.parameters[0].device  # NCCL reduces device tensors only
        both = torch.tensor([centred, noise], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.group)
        self.reductions += 1
        return float(both[0]) + float(both[1])

    @torch.no_grad()
    def _write_private_grads(self) -> None:
        """``p.grad = (Σ_r S_r + N(0, σ²Δ²I)) / B`` on every rank, from one all-reduce per group.

        The reduced noisy gradient is rounded to the same release grid as the single-process
        optimizer's (:func:`veil.optimizer.release_grid`, post-processing against the floating-point
        attack); every rank holds the same reduced values, so the rounding keeps replicas identical.
        With a secure source the next step's noise slice is drawn while the all-reduce is in flight
        (see the module docstring).
        """
        std = self.noise_std
        inverse = 1.0 / self.expected_batch_size
        sums = self.clipper.clipped_sum()
        params = self.clipper.parameters
        grid = release_grid(std * inverse) if std > 0 else None
        in_flight = []
        ahead = []
        for key, members in self._noise_groups().items():
            work, device = key
            numels = [params[i].numel() for i in members]
            flat = torch.cat([sums[i].reshape(-1).to(dtype=work, device=device) for i in members])
            flat.mul_(inverse)
            lo, hi = self.noise_slice(flat.numel())
            if std > 0 and hi > lo:
                flat[lo:hi].add_(self.noise_ahead.take(key, hi - lo, std * inverse))
                if self.overlap_noise and self.shares_noise:
                    ahead.append((key, hi - lo))
            work_handle = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.reductions += 1
            in_flight.append((work_handle, flat, members, numels))
        try:
            for key, numel in ahead:  # while the reductions are in flight: the next step's noise
                self.noise_ahead.prepare(key, numel, std * inverse, background=False)
        finally:  # a failed draw ahead still completes this step's collectives on every rank
            for work_handle, *_ in in_flight:
                work_handle.wait()
        for _, flat, members, numels in in_flight:
            if grid is not None:
                flat.div_(grid).round_().mul_(grid)  # exact: grid is a power of two
            for i, piece in zip(members, flat.split(numels), strict=True):
                p = params[i]
                g = piece.view(p.shape)
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
