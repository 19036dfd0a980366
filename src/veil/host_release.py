"""The DP step's release finished inside the noise draw: clipped sum added and grid applied per chunk.

What a logical step releases for a noise group is ``round((z + S/B) / g)·g``: the Gaussian draw ``z``,
the clipped sum ``S`` scaled by ``1/B``, rounded to the release grid ``g`` (:func:`veil.optimizer.
release_grid`). Done as whole-tensor torch ops after the draw, that is five passes over the group's
memory (the draw's write, the add, the division, the rounding, the multiplication): for a model of
22.7M parameters about 450 MB of memory traffic a step, on the same cores that compute the step. A
secure host draw is made in chunks that fit in the cache (:mod:`veil.mechanisms.box_muller`), so
:func:`finisher` returns the callback that adds the chunk's clipped sum and rounds it to the grid
there, on the thread that drew it, before the chunk leaves the cache: one write of the noise and
one read of the sum a step. With ``into`` (the default DP step, where nothing reads the clipped sums
after the release: :attr:`veil.optimizer.DPOptimizer.keep_clipped_sum`), each chunk is drawn into a
scratch buffer and its release written over the sums themselves, which become the gradients: no
model-sized noise buffer (91 MB for MiniLM) is allocated, page-faulted and freed each step.

Same release, same guarantee: every coordinate is ``z + S/B`` rounded once to float32, then
rounded to the grid (``× 1/g`` and ``× g`` are exact: ``g`` is a power of two; ``rint`` rounds half
to even like ``torch.round``). The only difference from the torch ops is where float32 rounds
``z + S·(1/B)``: torch fuses the product into the addition (one rounding), numpy rounds the product
first, so a value can differ by one float32 ulp before the grid, and by one or two grid steps where
that ulp straddles a grid midpoint — rare while ``|S/B|`` is near the noise's std (about 1e-5 of the
coordinates), common once it is 10⁴–10⁵ times larger (5–25 % measured in review), which a large batch
of agreeing examples can reach. Both are the Gaussian mechanism followed by a rounding that depends on
nothing private; the grid argument of :func:`veil.optimizer.release_grid` holds for either.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from veil.noise_ahead import Finish

__all__ = ["finisher"]


def finisher(sums: Sequence[torch.Tensor], alpha: float, grid: float, *, into: bool = False) -> Finish | None:
    """The callback ``(out, lo, hi)`` that turns ``out[lo:hi]`` of a float32 host draw into the release
    ``round((z + alpha·S) / grid)·grid``, where ``S`` is the concatenation of ``sums`` (the group's
    clipped sums, flattened, in order); ``None`` if a sum is not a float32 host tensor (the caller then
    finishes the draw with torch ops). Safe to call from several threads on disjoint slices.

    ``into``: the callback of :meth:`~veil.mechanisms.rng.RandomSource.host_release32` instead, whose
    ``out`` is a chunk holding coordinates ``lo … hi − 1``, only read: the same release is computed in
    ``S``'s own memory (``S·alpha`` rounded, the noise added, the grid applied there: the same float32
    operations, since addition commutes), so the sums become the released gradients and no second
    model-sized buffer, temporary or copy back is needed; ``None`` also where a sum is not contiguous
    (its numpy view would be a copy) or two sums share memory (a rule's views of one tensor: one
    write would change the other).
    """
    if into and not all(s.is_contiguous() for s in sums):
        return None
    storages = [s.untyped_storage().data_ptr() for s in sums if s.numel()]
    if into and len(set(storages)) < len(storages):  # two sums in one memory: a write would clobber
        return None
    try:  # numpy views (a copy only for a non-contiguous sum); a device or bf16 tensor has none
        arrays = [s.detach().numpy().reshape(-1) for s in sums]
    except (RuntimeError, TypeError):
        return None
    if any(a.dtype != np.float32 for a in arrays):
        return None
    offsets = list(itertools.accumulate((a.size for a in arrays), initial=0))
    scale, g = np.float32(alpha), np.float32(grid)
    # × 1/g equals ÷ g exactly when g and 1/g are normal float32 powers of two (release_grid's are)
    exact = math.frexp(grid)[0] == 0.5 and 2.0**-126 <= grid <= 2.0**126
    inverse = np.float32(1.0 / grid) if exact else g

    def slices(lo: int, hi: int) -> list[tuple[np.ndarray, int, int]]:
        """``(sum array, a, b)`` for each part of ``[lo, hi)`` inside one sum: coordinates ``a … b − 1``."""
        found = []
        i = bisect.bisect_right(offsets, lo) - 1
        while i < len(arrays) and offsets[i] < hi:
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                found.append((arrays[i][a - offsets[i] : b - offsets[i]], a, b))
            i += 1
        return found

    def to_grid(x: np.ndarray) -> None:
        if exact:  # g a normal power of two with a finite inverse: × 1/g is ÷ g exactly
            x *= inverse
        else:
            np.divide(x, g, out=x)
        np.rint(x, out=x)
        x *= g

    def finish(out: np.ndarray, lo: int, hi: int) -> None:
        for part, a, b in slices(lo, hi):
            out[a:b] += np.multiply(part, scale)
        to_grid(out[lo:hi])

    def finish_into(chunk: np.ndarray, lo: int, hi: int) -> None:
        # Computed in the sums' own memory: fl(S·alpha), then + z (float32 addition is commutative:
        # the same fl(z + fl(S·alpha)) as finish), then the grid. No temporary, no copy back, and
        # the chunk is only read (five passes over the sums instead of seven with the copy).
        for part, a, b in slices(lo, hi):
            part *= scale
            part += chunk[a - lo : b - lo]
            to_grid(part)

    return finish_into if into else finish
