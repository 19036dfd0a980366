"""The engine's Poisson sampler with its mask drawn in chunks, for tables too large to hold a mask of N.

:class:`veil.sampling.PoissonBatchSampler` draws one Bernoulli(q) mask over all N rows per step: about
17 bytes per row at once (the random words, their shift, the mask), which for a streamed table of
10⁸ rows is more memory than the rows a step reads. :class:`ChunkedPoissonSampler` draws the same mask
in chunks of :data:`CHUNK_ROWS` rows and keeps only the selected indices.

Guarantee. Each chunk is ``rng.bernoulli(len(chunk), q)``, the call the engine's sampler makes for the
whole mask: every row joins every step independently with realised probability ``⌊q·2⁵³⌋/2⁵³ ≤ q``, so
each step is the ``PoissonSampled(q, ·)`` event charged for it. The random words are consumed in the
same order (a seeded source yields exactly the engine sampler's batches and resume tokens: tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from veil.sampling import PoissonBatchSampler

__all__ = ["CHUNK_ROWS", "ChunkedPoissonSampler"]

CHUNK_ROWS = 1 << 20


class ChunkedPoissonSampler(PoissonBatchSampler):
    """:class:`~veil.sampling.PoissonBatchSampler` drawing its per-step mask ``chunk_rows`` rows at a time."""

    chunk_rows = CHUNK_ROWS

    @classmethod
    def like(cls, sampler: PoissonBatchSampler) -> ChunkedPoissonSampler:
        """The same sampler (size, q, steps per epoch, random source and position), chunked."""
        chunked = cls(sampler.dataset_size, sampler.sampling_rate, sampler.steps_per_epoch, sampler.rng)
        chunked.load_token(sampler.token())
        return chunked

    def _generate(self, start: int) -> Iterator[tuple[list[int], dict[str, Any]]]:
        n, q, chunk = self.dataset_size, self.sampling_rate, self.chunk_rows
        for k in range(start, self.steps_per_epoch):
            parts = [
                np.flatnonzero(np.asarray(self.rng.bernoulli(min(chunk, n - lo), q), dtype=bool)) + lo
                for lo in range(0, n, chunk)
            ]
            yield (
                np.concatenate(parts).tolist(),
                {
                    "rng": self._rng_state(),
                    "position": (k + 1) % self.steps_per_epoch,
                },
            )
