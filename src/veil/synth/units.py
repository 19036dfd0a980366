"""``veil synth --privacy-unit COLUMN``: bounded contribution per person in every marginal.

Rule. Each of unit ``u``'s ``n_u`` rows counts with weight ``1/n_u`` in every marginal the mechanism
measures or scores (:func:`unit_weights`). A unit's weights sum to 1, so adding or removing one unit
with all its rows changes any marginal's count table by a vector of L1 norm ≤ 1 (hence L2 ≤ 1): the
sensitivities MST and AIM are analysed with for one row (measurements: L2 1; selection scores: L1
distances, moved by at most 1, times the clique's weight) hold unchanged for a person. The events,
the ledger and the accountant are those of a row-level run, under add/remove-one-*unit*
neighbouring.

What the synthetic table then models: the distribution of one row drawn from a person drawn
uniformly (every person counts once, however many rows they have); the model's total is the number
of people, and ``--rows`` (public) sets how many synthetic rows are written. A row whose unit cell
is missing belongs to no unit and is dropped (a per-record rule). The unit column must be declared
``type = "ignored"`` in the schema (:mod:`veil.tables.units`) and is never written.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unit_weights"]


def unit_weights(ids: list[object]) -> tuple[np.ndarray, np.ndarray, int]:
    """``(kept rows mask, weight of each kept row = 1/n_u, number of units)`` for the rows' unit ids."""
    kept = np.array([v is not None for v in ids], dtype=bool)
    texts = np.array([str(v) for v in ids if v is not None], dtype=object)
    if len(texts) == 0:
        return kept, np.zeros(0), 0
    _, inverse, counts = np.unique(texts, return_inverse=True, return_counts=True)
    return kept, 1.0 / counts[inverse].astype(np.float64), len(counts)
