"""Privacy units: protect a person (every row sharing a unit id), not one row.

DP-SGD over units (user-level DP-SGD, Levy et al. 2021; Charles et al. 2024). The dataset's rows are
grouped by a unit id (a patient, a customer). Each logical step:

1. **Poisson sampling of units**: every unit joins the step independently with probability
   ``q = B_units / N_units`` (:class:`UnitPoissonSampler`; empty steps are kept).
2. **Bounded contribution**: a sampled unit contributes at most ``K`` of its rows
   (``max_rows_per_unit``, public), a fresh uniform choice without replacement among its rows when it
   has more than ``K`` (drawn from the sampler's random source, independently of the data's values).
3. **One clipped vector per unit**: the unit's gradient is the **mean** of its chosen rows' per-row
   gradients, clipped once to ``C`` (:attr:`veil.clipping.PerSampleClipper.unit_index`).
4. Gaussian noise ``N(0, σ²C²)`` on the sum, divided by ``B_units``, as for rows.

Guarantee. Neighbouring datasets differ by adding or removing *one unit with all its rows*. Under
that relation a step is exactly the Poisson-sampled Gaussian of row-level DP-SGD with ``q`` over
units and sensitivity ``C`` (a unit's inclusion is one Bernoulli(q) draw; its contribution is one
vector of norm ≤ C, whatever its number of rows), so the step's event is
``PoissonSampled(q_units, Gaussian(σ))`` and the accountant is unchanged. ``N_units`` (the number of
units) is public by declaration, as ``N`` is for rows; the ``K`` rows a unit contributes are chosen
by data-independent randomness, and ``K`` itself is public (:func:`default_max_rows_per_unit` is a
rule on public settings, never read off the data).

A unit with more than ``K`` rows still contributes one bounded vector (a random ``K`` of its rows
each step); a unit with fewer contributes all of them; a unit with no row in the training split is
not a unit of the training set at all (it contributes nothing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Sampler

from veil.errors import InvalidParameterError, SamplingError
from veil.sampling import PoissonBatchSampler, Token

if TYPE_CHECKING:
    from veil.clipping import PerSampleClipper
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "DEFAULT_ROWS_PER_STEP",
    "MAX_DEFAULT_ROWS_PER_UNIT",
    "UnitBatch",
    "UnitPlan",
    "UnitPoissonSampler",
    "check_max_rows_per_unit",
    "check_units",
    "default_max_rows_per_unit",
    "group_rows",
    "unit_setter",
]

DEFAULT_ROWS_PER_STEP = 1024
"""The default K keeps about this many rows per step in expectation (B_units · K)."""
MAX_DEFAULT_ROWS_PER_UNIT = 16
"""…and never more than this many rows per unit."""


def default_max_rows_per_unit(expected_units_per_step: int) -> int:
    """The default ``K``: ``clamp(⌊1024 / B_units⌋, 1, 16)``.

    A rule on a public setting (the expected units per step), never on the data: about 1024 rows per
    step at most in expectation (memory and time), and at most 16 rows per unit (the mean of a unit's
    rows gains little variance reduction beyond that while costing 16× the per-row work)."""
    b = max(int(expected_units_per_step), 1)
    return max(1, min(MAX_DEFAULT_ROWS_PER_UNIT, DEFAULT_ROWS_PER_STEP // b))


def check_max_rows_per_unit(k: Any) -> int:
    """``K`` must be a whole number ≥ 1."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InvalidParameterError(
            "max_rows_per_unit",
            k,
            "K bounds how many rows one unit contributes per step; below 1 a unit contributes nothing",
            "pass K ≥ 1 (or leave it out for the default rule)",
        )
    return int(k)


def group_rows(unit_ids: Sequence[Any] | np.ndarray) -> list[np.ndarray]:
    """The row indices of each unit (units in sorted id order, rows in dataset order).

    Only the grouping is kept; the ids themselves are not (they are identifiers, never features and
    never printed)."""
    ids = np.asarray(unit_ids)
    if ids.ndim != 1:
        raise InvalidParameterError(
            "unit_ids", f"shape {ids.shape}", "one unit id per row is needed", "pass a flat sequence"
        )
    _, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    return [part.astype(np.int64) for part in np.split(order, bounds)] if len(order) else []


class UnitBatch(list[int]):
    """A logical batch of row indices, grouped by unit: ``units[i]`` labels row ``self[i]``'s unit
    (``0..U−1`` in order of the sampled units; a unit's rows are consecutive)."""

    units: list[int]

    def __init__(self, rows: Sequence[int], units: Sequence[int]) -> None:
        super().__init__(rows)
        self.units = list(units)


class UnitPoissonSampler(PoissonBatchSampler, Sampler[list[int]]):
    """Poisson sampling of units, then at most ``K`` rows of each sampled unit (see the module doc).

    Guarantee: for every step and every unit the inclusion indicator is an independent Bernoulli(q)
    draw from ``rng`` (the accountant's ``PoissonSampled(q, ·)`` over units); a sampled unit with
    ``n > K`` rows contributes a uniform random ``K``-subset of them (the first ``K`` of a uniform
    permutation drawn from ``rng``), a unit with ``n ≤ K`` rows all of them. Yields
    :class:`UnitBatch` objects; ``len(sampler)`` is ``steps_per_epoch``.
    """

    def __init__(
        self,
        unit_rows: Sequence[np.ndarray],
        sampling_rate: float,
        steps_per_epoch: int,
        rng: RandomSource,
        max_rows_per_unit: int,
    ) -> None:
        super().__init__(len(unit_rows), sampling_rate, steps_per_epoch, rng)
        self.unit_rows = [np.asarray(r, dtype=np.int64) for r in unit_rows]
        self.max_rows_per_unit = check_max_rows_per_unit(max_rows_per_unit)

    def _generate(self, start: int) -> Iterator[tuple[list[int], Token]]:
        for k in range(start, self.steps_per_epoch):
            mask = np.asarray(self.rng.bernoulli(self.dataset_size, self.sampling_rate), dtype=bool)
            batch = self._rows_of(np.flatnonzero(mask))
            yield batch, {"rng": self._rng_state(), "position": (k + 1) % self.steps_per_epoch}

    def _rows_of(self, sampled: np.ndarray) -> UnitBatch:
        k = self.max_rows_per_unit
        chosen = [self.unit_rows[u] for u in sampled]
        over = [i for i, rows in enumerate(chosen) if len(rows) > k]
        if over:  # one draw for every unit over K: a uniform permutation of each, its first K rows
            sizes = [len(chosen[i]) for i in over]
            keys = np.split(np.asarray(self.rng.standard_normal(sum(sizes))), np.cumsum(sizes)[:-1])
            for i, key in zip(over, keys, strict=True):
                chosen[i] = chosen[i][np.argsort(key, kind="stable")[:k]]
        rows = [int(r) for part in chosen for r in part]
        labels = [label for label, part in enumerate(chosen) for _ in range(len(part))]
        return UnitBatch(rows, labels)


@dataclass(frozen=True)
class UnitPlan:
    """A privacy-unit run's grouping: the row indices of each unit, and K."""

    rows: list[np.ndarray]
    max_rows: int


def check_units(
    unit_ids: Sequence[Any] | None,
    max_rows_per_unit: int | None,
    n: int,
    batch_size: int,
    sampling: str,
    distributed: bool,
) -> UnitPlan | None:
    """Check a privacy-unit request (see :mod:`veil.units`) before anything is built."""
    if unit_ids is None:
        if max_rows_per_unit is not None:
            raise InvalidParameterError(
                "max_rows_per_unit",
                max_rows_per_unit,
                "K bounds the rows of one privacy unit, and no unit_ids were given",
                "pass unit_ids (one unit id per dataset row) or drop max_rows_per_unit",
            )
        return None
    k = (
        default_max_rows_per_unit(batch_size)
        if max_rows_per_unit is None
        else check_max_rows_per_unit(max_rows_per_unit)
    )
    if sampling != "poisson" or distributed:
        raise SamplingError(
            "unit_ids",
            "with " + ("several ranks" if distributed else "shuffled batches"),
            "unit-level DP-SGD is accounted for Poisson sampling of units in one process",
            "keep poisson_sampling=True and train in one process for a privacy-unit run",
        )
    if isinstance(unit_ids, (str, bytes)) or not hasattr(unit_ids, "__len__") or len(unit_ids) != n:
        raise InvalidParameterError(
            "unit_ids",
            f"{len(unit_ids) if hasattr(unit_ids, '__len__') else type(unit_ids).__name__} id(s)",
            f"each of the dataset's {n} rows must name its privacy unit",
            "pass one unit id per dataset row, in dataset order",
        )
    return UnitPlan(group_rows(unit_ids), k)


def unit_setter(clipper: PerSampleClipper) -> Any:
    """The loader's callback: each physical chunk's unit labels into the clipper (privacy units)."""

    def set_units(units: list[int] | None) -> None:
        clipper.unit_index = torch.as_tensor(units if units is not None else [], dtype=torch.long)

    return set_units
