"""Poisson sampling sharded across ranks: each example joins each step once, on exactly one rank.

Guarantee (what the accountant's ``PoissonSampled(q, ·)`` event assumes, whatever the world size):
for every logical step and every example ``i`` of the dataset of size ``N``, ``i`` belongs to the
step's global batch (the union of every rank's local batch) independently with probability ``q``,
and it can appear in the local batch of one rank only, the rank ``i mod W`` that owns it. The local
batches of a step are therefore disjoint and their union is a Poisson sample of the whole dataset.

How. Only the owner's draw decides an example's inclusion, so ranks need no shared randomness.
With a secure (OS CSPRNG) source each rank draws one Bernoulli(q) per example it owns, independent
of every other rank. With a seeded source (research mode) each rank draws the step's mask for all
``N`` examples and keeps the entries it owns: with the same seed on every rank the union of the local
batches is then exactly the batch a single process with that seed would draw. Empty local batches
are yielded like any other, so every rank takes every logical step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from veil.errors import InvalidParameterError
from veil.sampling import PoissonBatchSampler, Token

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource

__all__ = ["ShardedPoissonBatchSampler", "owner_of"]


def owner_of(index: int, world_size: int) -> int:
    """The rank whose Bernoulli draw decides whether example ``index`` is in a step's batch."""
    return index % world_size


class ShardedPoissonBatchSampler(PoissonBatchSampler):
    """This rank's part of a Poisson-sampled logical batch: the sampled examples it owns (see module).

    ``len(sampler)`` is ``steps_per_epoch`` on every rank, so all ranks take the same number of
    logical steps; local batch sizes are random (Binomial(|shard|, q)) and often 0 on small data.
    """

    def __init__(
        self,
        dataset_size: int,
        sampling_rate: float,
        steps_per_epoch: int,
        rng: RandomSource,
        *,
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__(dataset_size, sampling_rate, steps_per_epoch, rng)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidParameterError(
                "world_size", world_size, "the number of ranks is a positive count", "pass W ≥ 1"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidParameterError(
                "rank",
                rank,
                f"a rank lies in [0, {world_size}); another value would sample no shard or a shared one",
                "pass torch.distributed.get_rank()",
            )
        self.rank = rank
        self.world_size = world_size
        self.shard = np.arange(rank, self.dataset_size, world_size)

    def _generate(self, start: int) -> Iterator[tuple[list[int], Token]]:
        for k in range(start, self.steps_per_epoch):
            if self.rng.secure:  # one independent draw per owned example
                mine = np.asarray(self.rng.bernoulli(len(self.shard), self.sampling_rate), dtype=bool)
            else:  # the whole mask, as one process would draw it, then this rank's entries
                whole = np.asarray(self.rng.bernoulli(self.dataset_size, self.sampling_rate), dtype=bool)
                mine = whole[self.shard]
            indices = self.shard[mine].tolist()
            yield indices, {"rng": self._rng_state(), "position": (k + 1) % self.steps_per_epoch}
