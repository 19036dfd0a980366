"""The privacy settings of a DP-SGD run (:class:`PrivacyPlan`), apart from the engine that builds them.

:class:`veil.engine.PrivacyEngine` fixes the plan in ``make_private``; the distributed setup
(:mod:`veil.data_parallel.setup`) checks that every rank built the same one. Both import it from here, so
neither imports the other for it (``veil.engine`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from veil.accounting.base import AccountantName
from veil.accounting.events import Gaussian, NonPrivate, PrivacyEvent

__all__ = ["PrivacyPlan", "Sampling"]

Sampling = Literal["poisson", "shuffled_not_amplified"]
"""How batches are drawn: Poisson (amplified by sampling) or shuffled (accounted without amplification)."""


@dataclass(frozen=True)
class PrivacyPlan:
    """The privacy settings of a run, fixed by ``make_private``. Nothing about performance lives here."""

    noise_multiplier: float
    max_grad_norm: float
    sampling_rate: float
    expected_batch_size: int
    dataset_size: int
    steps_per_epoch: int
    sampling: Sampling
    clipping: Literal["flat", "per_layer"]
    loss_reduction: Literal["mean", "sum"]
    accountant: AccountantName
    privacy_unit: Literal["row", "unit"] = "row"
    """What one "example" of the guarantee is: a row, or a unit (every row sharing a unit id)."""
    max_rows_per_unit: int | None = None
    """K: rows one sampled unit contributes per step at most (privacy-unit runs; public)."""

    @property
    def event(self) -> PrivacyEvent:
        """The privacy event of one logical step (see :mod:`veil.engine`'s docstring)."""
        if self.noise_multiplier == 0:
            return NonPrivate()
        if self.sampling == "poisson":
            from veil.accounting.calibrate import dpsgd_event

            return dpsgd_event(self.sampling_rate, self.noise_multiplier)  # plain Gaussian when q = 1
        return Gaussian(self.noise_multiplier / 2)
