"""MST's domain compression: rare levels (noisy count below 3σ) merged into one cell, and back.

Post-processing of the noisy 1-way marginals only. A column whose noisy 1-way counts put two or
more levels below ``3σ`` gets those levels merged into one cell for the rest of the fit (fewer
cells to measure, less noise per useful cell); synthetic rows in the merged cell get one of its
original levels drawn in proportion to their (clipped) noisy counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from veil.mechanisms.rng import RandomSource
from veil.synth.pgm import Measurement

__all__ = ["Compression", "compress"]


@dataclass(frozen=True)
class Compression:
    """Per column: old level → new cell (``maps``), and the merged levels' sampling weights."""

    maps: tuple[np.ndarray, ...]
    sizes: tuple[int, ...]
    weights: tuple[np.ndarray, ...]

    def apply(self, codes: np.ndarray) -> np.ndarray:
        return np.stack([m[codes[:, i]] for i, m in enumerate(self.maps)], axis=1)

    def measurement(self, i: int, m: Measurement) -> Measurement:
        """A 1-way measurement of column ``i`` summed onto the compressed cells."""
        k = self.sizes[i]
        y = np.bincount(self.maps[i], weights=m.y, minlength=k)
        var = np.bincount(self.maps[i], weights=1.0 / m.weight, minlength=k)
        return Measurement(m.attrs, y, 1.0 / var, m.sigma)

    def restore(self, codes: np.ndarray, rng: RandomSource) -> np.ndarray:
        """Compressed codes back to original levels (the merged cell's levels drawn by weight)."""
        out = np.empty_like(codes)
        for i, m in enumerate(self.maps):
            col = codes[:, i]
            merged = self.sizes[i] - 1 if len(m) > self.sizes[i] else -1
            inverse = np.zeros(self.sizes[i], dtype=np.int64)
            inverse[m] = np.arange(len(m))  # unmerged cells: their one level
            values = inverse[col]
            if merged >= 0:
                rows = np.flatnonzero(col == merged)
                levels = np.flatnonzero(m == merged)
                w = self.weights[i]
                cdf = np.cumsum(w) / w.sum()
                pick = np.searchsorted(cdf, rng.uniform(rows.size), side="right")
                values[rows] = levels[np.minimum(pick, levels.size - 1)]
            out[:, i] = values
        return out


def compress(one_way: list[Measurement], sizes: tuple[int, ...]) -> Compression:
    """Merge each column's levels whose noisy count is below 3σ (when there are two or more)."""
    maps, new_sizes, weights = [], [], []
    for m, k in zip(one_way, sizes, strict=True):
        rare = m.y < 3 * m.sigma
        if rare.sum() < 2:
            maps.append(np.arange(k))
            new_sizes.append(k)
            weights.append(np.ones(1))
            continue
        keep = np.flatnonzero(~rare)
        mp = np.full(k, len(keep), dtype=np.int64)
        mp[keep] = np.arange(len(keep))
        maps.append(mp)
        new_sizes.append(len(keep) + 1)
        w = np.clip(m.y[rare], 0, None)
        weights.append(w if w.sum() > 0 else np.ones(int(rare.sum())))
    return Compression(tuple(maps), tuple(new_sizes), tuple(weights))
