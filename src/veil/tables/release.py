"""DP releases of a column's public domain: its kind, numeric bounds (DP quantiles), levels (noisy counts).

Guarantee. Neighbouring tables differ by adding or removing one row (``ADD_OR_REMOVE_ONE``). Each
function below touches one column and is, on its own:

* :func:`noisy_kind_counts` — the counts of (number, text, missing) cells plus ``Lap(b)`` each. One
  row is in exactly one bucket, so the vector has L1 sensitivity 1: pure ``ε = 1/b``.
* :func:`dp_bounds` — a lower and an upper bound on a fixed public log-scale grid of round numbers
  (:func:`bound_grid`, ±1e-4 … ±9e12): one noisy histogram of the values over the grid's cells (each
  row in exactly one cell: L1 sensitivity 1, pure ``ε = 1/b``), then post-processing only — the outer
  ends of the outermost cells whose noisy count clears a threshold, trimmed by 1 % of a count already
  released. One Laplace event, which the PLD accountant composes like every other release here.
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

import numpy as np

from veil.accounting.events import Laplace, PrivacyEvent
from veil.errors import InvalidParameterError
from veil.mechanisms.laplace import GRID_BITS, laplace_mechanism
from veil.mechanisms.rng import RandomSource

__all__ = [
    "FAILURE_RATE",
    "BoundsRelease",
    "LevelsRelease",
    "bound_grid",
    "bounds_plan",
    "cell_counts",
    "dp_bounds",
    "noisy_kind_counts",
    "occupancy_threshold",
    "release_event",
    "scale_for",
    "thresholded_levels",
]

QUANTILE = 0.01
"""Bounds aim at the 1 % and 99 % quantiles: a few outliers are clipped, the bulk is kept."""


def bound_grid() -> np.ndarray:
    """The public candidate bounds: 0 and ±m·10^k, m ∈ {1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9}, k ∈ [−4, 12]."""
    mantissas = np.array([1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9], dtype=np.float64)
    positive = (mantissas[None, :] * 10.0 ** np.arange(-4, 13)[:, None]).ravel()
    return np.unique(np.concatenate([-positive, [0.0], positive]))


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
    threshold: float
    """τ: a grid cell counts as holding data when its noisy count exceeds it (public: from ε alone)."""
    needs_review: str | None = None
    """Why a person should look at these bounds (None: usable as they are); post-processing only."""


FAILURE_RATE = 1e-3
"""β: the chance that any empty grid cell looks occupied (a bound then lies past the data)."""


def cell_counts(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """How many values fall in each cell of the grid: ``(−∞, g_0], (g_0, g_1], …, (g_last, ∞)``.

    Each value is in exactly one cell, so adding or removing a row changes one count by 1: the vector
    has L1 sensitivity 1."""
    cells = np.searchsorted(grid, np.asarray(values, dtype=np.float64), side="left")
    return np.bincount(cells, minlength=len(grid) + 1).astype(np.float64)


def occupancy_threshold(scale: float, cells: int) -> float:
    """τ = b·ln(cells/(2β)): an empty cell's noisy count ``Lap(b)`` exceeds it with probability
    ``½·exp(−τ/b) = β/cells``, so no empty cell does with probability ≥ 1 − β."""
    return scale * math.log(cells / (2 * FAILURE_RATE))


def dp_bounds(
    values: np.ndarray, epsilon: float, rng: RandomSource, rows_hint: float | None = None
) -> BoundsRelease:
    """DP lower/upper bounds of the finite ``values`` on :func:`bound_grid`; pure ε = ``epsilon``.

    Method: one noisy histogram of the values over the public grid's cells (:func:`cell_counts`, one
    Laplace release, L1 sensitivity 1 under add/remove-one), then post-processing only. A cell is
    *occupied* when its noisy count exceeds τ (:func:`occupancy_threshold`); walking in from each end
    over occupied cells, the bound is the outer end of the first cell at which the noisy counts passed
    add up to more than 1 % of ``rows_hint`` (a count already released, e.g. the noisy number count;
    None: the values are taken as public, as in tests). With probability ≥ 1 − β (β =
    :data:`FAILURE_RATE`) no empty cell is occupied, so neither bound lies past the data's outermost
    cells; a cell holding more than τ + b·ln(1/(2β)) values is found with probability ≥ 1 − β. On the
    round-number grid a cell spans a factor ≤ 1.5, so bounds land within that factor of the extreme
    values kept. The bounds returned are always an interval (``low < high``); no cell occupied gives
    the whole grid, flagged for review."""
    grid = bound_grid()
    scale = scale_for(epsilon, rng.secure)
    noisy = _release(cell_counts(values, grid), scale, rng)
    tau = occupancy_threshold(scale, len(noisy))
    cut = QUANTILE * max(float(len(values)) if rows_hint is None else rows_hint, 0.0)
    mass = np.where(noisy > tau, noisy, 0.0)
    occupied = np.flatnonzero(mass)
    if occupied.size == 0:
        low, high = 0, len(grid) - 1
    else:
        if mass.sum() > cut:  # trim up to `cut` (noisy) values from each end, whole cells at a time
            first = int(np.argmax(np.cumsum(mass) > cut))
            last = len(mass) - 1 - int(np.argmax(np.cumsum(mass[::-1]) > cut))
        else:
            first, last = int(occupied[0]), int(occupied[-1])
        low = max(first - 1, 0)  # cell j is (g_{j-1}, g_j]: its outer ends
        high = min(last, len(grid) - 1)
    if high <= low:
        high = min(low + 1, len(grid) - 1)
        low = high - 1
    review = _bounds_review(float(grid[low]), float(grid[high]), tau, cut, occupied.size == 0)
    return BoundsRelease(float(grid[low]), float(grid[high]), release_event(scale, rng.secure), tau, review)


def bounds_plan(epsilon: float, secure: bool) -> PrivacyEvent:
    """The event :func:`dp_bounds` charges at ``epsilon``, known before any data is read."""
    return release_event(scale_for(epsilon, secure), secure)


def _bounds_review(low: float, high: float, tau: float, cut: float, empty: bool) -> str | None:
    """Why a person should decide these bounds, from released values only (post-processing)."""
    if empty:
        return "no grid cell held enough values to be seen at this ε: set the column's real range"
    edge = bound_grid()[[0, -1]]
    if low <= edge[0] or high >= edge[1]:
        return "a bound reached the edge of the public grid (±9e12): set the column's real range"
    if cut < tau:
        return (
            f"few rows for this ε: an end cell holding fewer than about {tau:.0f} values is cut (not only "
            "the outer 1 %), so the tails may be clipped; widen the bounds to the column's public range"
        )
    return None


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
