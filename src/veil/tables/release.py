"""DP releases of a column's public domain: its kind, numeric bounds (DP quantiles), levels (noisy counts).

Guarantee. Neighbouring tables differ by adding or removing one row (``ADD_OR_REMOVE_ONE``). Each
function below touches one column and is, on its own:

* :func:`noisy_kind_counts` — the counts of (number, text, missing) cells plus ``Lap(b)`` each. One
  row is in exactly one bucket, so the vector has L1 sensitivity 1: pure ``ε = 1/b``.
* :func:`dp_bounds` — a lower and an upper bound chosen on a fixed public grid of round numbers
  (:func:`bound_grid`) by noisy binary search: each of ``2·S`` comparisons releases
  ``#{x < g} − p·n + Lap(b)`` (lower) or ``#{x > g} − p·n + Lap(b)`` (upper), a quantity that one
  row moves by at most ``max(p, 1 − p) ≤ 1``. ``S = ⌈log₂ |grid|⌉`` comparisons per bound are
  always charged, even when the search ends sooner: pure ``ε = 2S/b`` in all.
* :func:`thresholded_levels` — the stability-based histogram: every value present in the column gets
  its count plus ``Lap(b)`` and is released only if that exceeds ``τ = 1 + b·ln(1/(2δ))``. A value
  that only one row holds (present in one table, absent in its neighbour) is released with
  probability ``½·exp(−(τ − 1)/b) = δ``; every other change moves one count by 1. So
  ``(ε = 1/b, δ)``-DP.

Every release uses :func:`veil.mechanisms.laplace_mechanism` (secure lattice sampling when the
source is secure). The event returned for a release is chosen before seeing the data: in secure mode
a Laplace event whose sensitivity ``1 + b·2⁻²⁰·(1 + 2⁻²⁰)`` dominates the mechanism's lattice
correction for any number of coordinates (``d·Λ ≤ b·2⁻²⁰`` by the lattice's definition), so the
event does not reveal how many distinct values a column has. The threshold's δ is not an event the
accountants know; it is returned apart and added to δ by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.accounting.events import Laplace, PrivacyEvent, SelfComposed
from veil.errors import InvalidParameterError
from veil.mechanisms.laplace import GRID_BITS, laplace_mechanism
from veil.mechanisms.rng import RandomSource

__all__ = [
    "BoundsRelease",
    "LevelsRelease",
    "bound_grid",
    "dp_bounds",
    "noisy_kind_counts",
    "release_event",
    "scale_for",
    "search_steps",
    "thresholded_levels",
]

QUANTILE = 0.01
"""Bounds aim at the 1 % and 99 % quantiles: a few outliers are clipped, the bulk is kept."""


def bound_grid() -> np.ndarray:
    """The public candidate bounds: 0 and ±m·10^k, m ∈ {1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9}, k ∈ [−4, 12]."""
    mantissas = np.array([1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9], dtype=np.float64)
    positive = (mantissas[None, :] * 10.0 ** np.arange(-4, 13)[:, None]).ravel()
    return np.unique(np.concatenate([-positive, [0.0], positive]))


def search_steps(grid_size: int) -> int:
    """Comparisons charged per bound: ⌈log₂ grid_size⌉ (enough for a binary search to finish)."""
    return max(1, math.ceil(math.log2(grid_size)))


def release_event(scale: float, secure: bool) -> Laplace:
    """The event charged for one L1-sensitivity-1 release with ``Lap(scale)`` (see the module docstring)."""
    if not secure:
        return Laplace(scale=scale, sensitivity=1.0)
    bound = 1.0 + scale * 2.0**-GRID_BITS * (1.0 + 2.0**-GRID_BITS)
    return Laplace(scale=scale, sensitivity=math.nextafter(math.nextafter(bound, math.inf), math.inf))


def scale_for(epsilon: float, secure: bool) -> float:
    """The Laplace scale whose charged event (:func:`release_event`) costs at most ``epsilon``."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise InvalidParameterError("epsilon", epsilon, "a release needs a finite budget ε > 0", "pass ε > 0")
    b = 1.0 / epsilon
    if secure:
        slack = 2.0**-GRID_BITS * (1.0 + 2.0**-GRID_BITS)
        if epsilon <= 2 * slack:
            raise InvalidParameterError(
                "epsilon",
                epsilon,
                "the budget per release is below the secure lattice's resolution",
                "raise ε",
            )
        b = 1.0 / (epsilon - slack)
    while release_event(b, secure).pure_epsilon > epsilon:
        b = math.nextafter(b, math.inf)
    return b


def _release(values: np.ndarray, scale: float, rng: RandomSource) -> np.ndarray:
    result = laplace_mechanism(values.astype(np.float64), sensitivity=1.0, scale=scale, rng=rng)
    charged = release_event(scale, rng.secure)
    actual = result.event
    assert isinstance(actual, Laplace) and actual.scale == charged.scale
    if actual.sensitivity > charged.sensitivity:  # pragma: no cover - excluded by the lattice's definition
        raise RuntimeError(f"released {actual}, more than the charged {charged}")
    return np.atleast_1d(np.asarray(result.value, dtype=np.float64))


def noisy_kind_counts(
    n_number: int, n_text: int, n_missing: int, scale: float, rng: RandomSource
) -> tuple[np.ndarray, PrivacyEvent]:
    """Noisy (number, text, missing) cell counts of one column; pure ε = 1/scale."""
    counts = np.array([n_number, n_text, n_missing], dtype=np.float64)
    return _release(counts, scale, rng), release_event(scale, rng.secure)


@dataclass(frozen=True)
class BoundsRelease:
    low: float
    high: float
    event: PrivacyEvent


def _search(
    count_beyond: np.ndarray, n: int, side: Literal["lower", "upper"], scale: float, rng: RandomSource
) -> int:
    """Noisy binary search over grid indices (see :func:`dp_bounds`)."""
    grid_size = len(count_beyond)
    lo, hi = 0, grid_size - 1
    for _ in range(search_steps(grid_size)):
        if lo >= hi:
            break
        if side == "lower":  # the largest i with #{x < g_i} − p·n ≤ 0
            mid = (lo + hi + 1) // 2
            noisy = _release(np.array([count_beyond[mid] - QUANTILE * n]), scale, rng)[0]
            lo, hi = (mid, hi) if noisy <= 0 else (lo, mid - 1)
        else:  # the smallest i with #{x > g_i} − p·n ≤ 0
            mid = (lo + hi) // 2
            noisy = _release(np.array([count_beyond[mid] - QUANTILE * n]), scale, rng)[0]
            lo, hi = (lo, mid) if noisy <= 0 else (mid + 1, hi)
    return lo


def dp_bounds(values: np.ndarray, epsilon: float, rng: RandomSource) -> BoundsRelease:
    """DP lower/upper bounds of the finite ``values`` on :func:`bound_grid`; pure ε ≤ ``epsilon``.

    ``epsilon`` is split evenly over the ``2·S`` comparisons. The bounds returned are always a valid
    interval (``low < high``): if noise makes them cross or meet, the next grid point above ``low``
    is used (post-processing, no extra cost).
    """
    grid = bound_grid()
    steps = search_steps(len(grid))
    scale = scale_for(epsilon / (2 * steps), rng.secure)
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = len(x)
    below = np.searchsorted(x, grid, side="left")  # #{x < g}
    above = n - np.searchsorted(x, grid, side="right")  # #{x > g}
    i_lo = _search(below, n, "lower", scale, rng)
    i_hi = _search(above, n, "upper", scale, rng)
    if i_hi <= i_lo:
        i_hi = min(i_lo + 1, len(grid) - 1)
        i_lo = i_hi - 1
    return BoundsRelease(
        float(grid[i_lo]), float(grid[i_hi]), SelfComposed(release_event(scale, rng.secure), 2 * steps)
    )


@dataclass(frozen=True)
class LevelsRelease:
    levels: tuple[str, ...]
    """Released values, most frequent (noisy) first."""
    event: PrivacyEvent
    threshold_delta: float


def threshold_for(scale: float, delta: float) -> float:
    """τ = 1 + b·ln(1/(2δ)): a value held by one row passes with probability δ."""
    return 1.0 + scale * math.log(1.0 / (2.0 * delta))


def thresholded_levels(
    counts: dict[str, int], epsilon: float, delta: float, rng: RandomSource, max_levels: int
) -> LevelsRelease:
    """Values whose noisy count passes the threshold; ``(ε ≤ epsilon, δ = delta)``-DP.

    Keeping at most ``max_levels`` of them (the largest noisy counts) is post-processing.
    """
    scale = scale_for(epsilon, rng.secure)
    tau = threshold_for(scale, delta)
    names = sorted(counts)
    kept: list[tuple[float, str]] = []
    if names:
        noisy = _release(np.array([counts[v] for v in names], dtype=np.float64), scale, rng)
        kept = sorted(((-float(c), v) for c, v in zip(noisy, names, strict=True) if c > tau))
    levels = tuple(v for _, v in kept[:max_levels])
    return LevelsRelease(levels, release_event(scale, rng.secure), delta)
