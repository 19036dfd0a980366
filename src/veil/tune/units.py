"""``veil tune`` with a privacy unit: the validation split and the score protect people, not rows.

Guarantee (add/remove one unit with all its rows). Three things change with ``privacy_unit``:

* the validation split holds whole units, drawn from the OS CSPRNG among the training split's units
  (:func:`validation_mask`), so a person is either trained on or scored on, never both;
* each trial trains with unit-level DP-SGD (the train job's engine, :mod:`veil.units`);
* the score is the sum over validation units of each unit's *share* of correct predictions
  (:func:`correct_count`): a unit moves it by at most 1, whatever its number of rows, so the noisy
  count keeps sensitivity 1 — where the plain count of correct rows would move by a person's rows.

The noisy score is then divided by the number of validation units (public, as N_units is).
"""

from __future__ import annotations

import secrets

import numpy as np

__all__ = ["correct_count", "records_outside", "validation_mask"]


def validation_mask(n: int, fraction: float, units: np.ndarray | None) -> np.ndarray:
    """A held-out share of the training split (rows, or whole units), drawn from the OS CSPRNG."""
    rng = np.random.default_rng(secrets.randbits(128))
    if units is None:
        n_val = max(1, round(fraction * n))
        mask = np.zeros(n, dtype=bool)
        mask[rng.permutation(n)[:n_val]] = True
        return mask
    distinct = np.unique(units)
    chosen = distinct[rng.permutation(len(distinct))[: max(1, round(fraction * len(distinct)))]]
    return np.isin(units, chosen)


def correct_count(correct: np.ndarray, units: np.ndarray | None) -> float:
    """Correct rows (row level), or Σ over units of the unit's share of correct rows (sensitivity 1)."""
    if units is None:
        return float(np.sum(correct))
    _, inverse, rows = np.unique(units, return_inverse=True, return_counts=True)
    per_unit = np.bincount(inverse, weights=correct.astype(np.float64), minlength=len(rows))
    return float(np.sum(per_unit / rows))


def records_outside(mask: np.ndarray, units: np.ndarray | None) -> int:
    """What the trials train on, counted as the guarantee counts: rows, or units, outside ``mask``."""
    if units is None:
        return int((~mask).sum())
    return len(np.unique(units[~mask]))
