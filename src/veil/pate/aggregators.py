"""Noisy aggregation of teacher votes: LNMax, GNMax and Confident-GNMax.

Each call answers one query from its vote histogram (one count per class, summing to the number
of teachers) and returns the privacy events it spent, so the caller's accountant composes exactly
what was run. Noise comes from a :class:`~veil.mechanisms.RandomSource`; with a secure source the
noisy max and the threshold check use the exact lattice samplers of :mod:`veil.mechanisms`.

* LNMax (Papernot et al. 2017): ``argmax_j n_j + Lap(b)``; pure ``2/b``-DP per answer.
* GNMax (Papernot et al. 2018): ``argmax_j n_j + N(0, σ²)``; L2 sensitivity √2.
* Confident-GNMax (Papernot et al. 2018, Alg. 1): release ``max_j n_j + N(0, σ₁²)`` (sensitivity
  1); only if it is ≥ T answer with GNMax(σ₂). The threshold check is spent on every query asked,
  answered or not.

Neighbouring relation: one teacher changes its vote (see :mod:`veil.pate.analysis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.accounting.events import Gaussian, PrivacyEvent
from veil.errors import InvalidParameterError
from veil.mechanisms import (
    gaussian_event,
    gaussian_mechanism,
    lattice_spacing,
    noisy_max_event,
    report_noisy_max,
)
from veil.mechanisms.rng import RandomSource

__all__ = ["AGGREGATORS", "Aggregator", "AggregatorName", "Answer", "answer_query"]

AggregatorName = Literal["lnmax", "gnmax", "confident-gnmax"]
AGGREGATORS: tuple[AggregatorName, ...] = ("lnmax", "gnmax", "confident-gnmax")


def _check_positive(name: str, value: float | None, what: str) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, value, f"{what} sets the privacy guarantee", f"pass {name} > 0")
    if not (math.isfinite(value) and value > 0):
        raise InvalidParameterError(name, value, f"{what} must be finite and positive", f"pass {name} > 0")
    return float(value)


@dataclass(frozen=True)
class Aggregator:
    """An aggregator and its noise, in units of votes.

    ``scale``: the Laplace scale ``b`` (LNMax) or the Gaussian std ``σ`` (GNMax, and ``σ₂`` of
    Confident-GNMax). ``threshold`` ``T`` and ``sigma1`` ``σ₁``: Confident-GNMax only.
    """

    name: AggregatorName
    scale: float
    threshold: float | None = None
    sigma1: float | None = None

    def __post_init__(self) -> None:
        if self.name not in AGGREGATORS:
            raise InvalidParameterError(
                "aggregator",
                self.name,
                "only LNMax, GNMax and Confident-GNMax have a privacy analysis here",
                f"use one of {', '.join(AGGREGATORS)}",
            )
        _check_positive("scale", self.scale, "the noise scale")
        if self.name == "confident-gnmax":
            _check_positive("sigma1", self.sigma1, "the threshold noise σ₁")
            if self.threshold is None or not math.isfinite(float(self.threshold)):
                raise InvalidParameterError(
                    "threshold", self.threshold, "Confident-GNMax needs a finite threshold T", "pass T"
                )
        elif self.threshold is not None or self.sigma1 is not None:
            raise InvalidParameterError(
                "threshold",
                self.threshold,
                f"{self.name} has no threshold check; a threshold here would be silently ignored",
                "drop threshold/sigma1, or use aggregator='confident-gnmax'",
            )

    def answer_event(self, secure: bool) -> PrivacyEvent:
        """The event of one answer (the noisy max)."""
        return noisy_max_event("laplace" if self.name == "lnmax" else "gaussian", self.scale, secure=secure)

    def threshold_event(self, secure: bool) -> Gaussian:
        """The event of one threshold check (Confident-GNMax only)."""
        assert self.sigma1 is not None
        return gaussian_event(1.0, self.sigma1, coordinates=1, secure=secure)

    def answer_lattice(self, secure: bool) -> float:
        """The secure lattice of the noisy max in votes (0 in seeded mode)."""
        return min(1.0, lattice_spacing(self.scale, 1.0)) if secure else 0.0

    def threshold_lattice(self, secure: bool) -> float:
        """The secure lattice of the threshold check in votes (0 in seeded mode)."""
        return lattice_spacing(float(self.sigma1), 1.0) if (secure and self.sigma1) else 0.0


@dataclass(frozen=True)
class Answer:
    """One query's outcome: the label (None if not answered) and the events spent on it.

    Only the label (or its absence) is released: the data-dependent analysis of the threshold
    check bounds the one-bit outcome, not the noisy count, which is therefore not kept.
    """

    label: int | None
    events: tuple[PrivacyEvent, ...]


def _check_histogram(counts: np.ndarray | list[int]) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 1 or c.size < 2 or not np.issubdtype(c.dtype, np.integer) or np.any(c < 0):
        raise InvalidParameterError(
            "counts",
            getattr(c, "shape", c),
            "a vote histogram is one non-negative integer count per class",
            "pass np.bincount(votes, minlength=num_classes)",
        )
    return c


def answer_query(agg: Aggregator, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
    """Answer one query with ``agg`` on the vote histogram ``counts``."""
    c = _check_histogram(counts)
    if agg.name == "lnmax":
        res = report_noisy_max(c, "laplace", agg.scale, rng)
        return Answer(res.index, (res.event,))
    if agg.name == "gnmax":
        res = report_noisy_max(c, "gaussian", agg.scale, rng)
        return Answer(res.index, (res.event,))
    assert agg.sigma1 is not None and agg.threshold is not None
    check = gaussian_mechanism(float(c.max()), sensitivity=1.0, std=agg.sigma1, rng=rng)
    if float(check.value) < agg.threshold:
        return Answer(None, (check.event,))
    res = report_noisy_max(c, "gaussian", agg.scale, rng)
    return Answer(res.index, (check.event, res.event))
