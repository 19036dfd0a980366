"""Utility of a synthetic table against the real one: total-variation distance of marginals.

Computed from the real data without noise: **non-private**, for internal evaluation (the report's
``non_private`` section and the benchmark), never part of a release.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from veil.synth.pgm import marginal_counts

__all__ = ["marginal_tv", "mean_tv"]


def marginal_tv(
    real: np.ndarray, synthetic: np.ndarray, sizes: Sequence[int], attrs: tuple[int, ...]
) -> float:
    """½‖p_real − p_synthetic‖₁ of the marginal over ``attrs`` (each table normalised)."""
    a = marginal_counts(real, sizes, attrs).ravel()
    b = marginal_counts(synthetic, sizes, attrs).ravel()
    return 0.5 * float(np.abs(a / max(a.sum(), 1) - b / max(b.sum(), 1)).sum())


def mean_tv(
    real: np.ndarray, synthetic: np.ndarray, sizes: Sequence[int], degree: int, limit: int | None = None
) -> float | None:
    """The average TV over every marginal of ``degree`` columns (None when there are none).

    ``limit`` caps the number of marginals (the first ``limit`` in lexicographic order)."""
    cliques = list(itertools.combinations(range(len(sizes)), degree))
    if limit is not None:
        cliques = cliques[:limit]
    if not cliques:
        return None
    return float(np.mean([marginal_tv(real, synthetic, sizes, c) for c in cliques]))
