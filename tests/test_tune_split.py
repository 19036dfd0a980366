"""``veil tune``'s validation split is a function of each record alone (issue 23, item 4)."""

from __future__ import annotations

import dataclasses

import numpy as np

from veil.data import load_dataset


def test_validation_split_keeps_add_remove_neighbours_on_the_training_part() -> None:
    """Remove one record of the training split, or add one: every other record keeps its side, so the
    training parts of the two runs differ by at most that record (add/remove, never replace-one).
    Deterministic: the split is a keyed hash (no randomness to fail on)."""
    from veil.tune.run import validation_mask

    data = load_dataset("digits", seed=0)
    full = validation_mask(data, 0.2, seed=0)
    assert np.array_equal(full, validation_mask(data, 0.2, seed=0))  # the record decides, nothing else
    for drop in (0, 7, data.n_train // 2, data.n_train - 1):
        keep = np.arange(data.n_train) != drop
        smaller = dataclasses.replace(data, x_train=data.x_train[keep], y_train=data.y_train[keep])
        assert np.array_equal(validation_mask(smaller, 0.2, seed=0), full[keep])
    # The held-out share is about the fraction (binomial, 1437 rows: ±5 σ ≈ ±0.053).
    assert abs(full.mean() - 0.2) < 0.053
    # A fixed-size subset cannot be what this is: sizes vary across keys (seeds).
    sizes = {int(validation_mask(data, 0.2, seed=s).sum()) for s in range(5)}
    assert len(sizes) > 1
