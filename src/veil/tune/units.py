"""``veil tune`` with a privacy unit: the validation split and the score protect people, not rows.

Guarantee (add/remove one unit with all its rows). Three things change with ``privacy_unit``:

* the validation split holds whole units, by a keyed hash of the unit
  (:func:`veil.tune.run.validation_mask`), so a person is either trained on or scored on, never both;
* each trial trains with unit-level DP-SGD (the train job's engine, :mod:`veil.units`);
* the score is the sum over validation units of each unit's *share* of correct predictions
  (:func:`correct_count`): a unit moves it by at most 1, whatever its number of rows, so the noisy
  count keeps sensitivity 1 — where the plain count of correct rows would move by a person's rows.

The noisy score is then divided by the number of validation units (public, as N_units is).
"""

from __future__ import annotations

import numpy as np

__all__ = ["correct_count", "records_outside"]


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
