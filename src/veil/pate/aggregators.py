"""Noisy aggregation of teacher votes: LNMax, GNMax and Confident-GNMax, one small object each.

Every aggregator has the same interface:

* :meth:`Aggregator.answer` answers one query from its vote histogram (one count per class,
  summing to the number of teachers with data, at most K: a teacher without data abstains, see
  :mod:`veil.pate.partition`) and returns the label and the privacy events it spent, so
  the caller's accountant composes exactly what was run;
* the data-independent analysis: :meth:`Aggregator.query_events` (the worst case of one query),
  :meth:`Aggregator.epsilon_of` (the ε of the events spent, read from an
  :class:`~veil.pate.spending.EventTally`) and
  :meth:`Aggregator.data_independent_budget` (the stopping rule that keeps every path within a
  target, fixed from public parameters before any vote is seen);
* the data-dependent analysis: :meth:`Aggregator.account_data_dependent` adds one answered
  query's data-dependent cost to a :class:`~veil.pate.smooth_sensitivity.DataDependentAccount`
  (GNMax and Confident-GNMax; LNMax has none).

Noise comes from a :class:`~veil.mechanisms.RandomSource`; with a secure source the noisy max and
the threshold check use the exact lattice samplers of :mod:`veil.mechanisms`.

* LNMax (Papernot et al. 2017): ``argmax_j n_j + Lap(b)``; pure ``2/b``-DP per answer.
* GNMax (Papernot et al. 2018): ``argmax_j n_j + N(0, σ²)``; L2 sensitivity √2.
* Confident-GNMax (Papernot et al. 2018, Alg. 1): release ``max_j n_j + N(0, σ₁²)`` (sensitivity
  1); only if it is ≥ T answer with GNMax(σ₂). The threshold check is spent on every query asked,
  answered or not.

Neighbouring relation: one teacher changes its vote (see :mod:`veil.pate.analysis`).
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

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
from veil.pate.spending import (
    AnswerCap,
    DataIndependentBudget,
    EventTally,
    RenyiFilter,
    largest,
    largest_rho,
    rdp_epsilon,
    too_small,
)

if TYPE_CHECKING:
    from veil.pate.smooth_sensitivity import DataDependentAccount

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "AggregatorName",
    "Answer",
    "ConfidentGNMax",
    "GNMax",
    "LNMax",
    "answer_query",
    "make_aggregator",
]

AggregatorName = Literal["lnmax", "gnmax", "confident-gnmax"]
AGGREGATORS: tuple[AggregatorName, ...] = ("lnmax", "gnmax", "confident-gnmax")


def _check_positive(name: str, value: float | None, what: str) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, value, f"{what} sets the privacy guarantee", f"pass {name} > 0")
    if not (math.isfinite(value) and value > 0):
        raise InvalidParameterError(name, value, f"{what} must be finite and positive", f"pass {name} > 0")
    return float(value)


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


@dataclass(frozen=True)
class Answer:
    """One query's outcome: the label (None if not answered) and the events spent on it.

    Only the label (or its absence) is released: the data-dependent analysis of the threshold
    check bounds the one-bit outcome, not the noisy count, which is therefore not kept.
    """

    label: int | None
    events: tuple[PrivacyEvent, ...]


class _BuiltByName(ABCMeta):
    """``Aggregator(name, scale, threshold=None, sigma1=None)`` builds the named aggregator (see
    :func:`make_aggregator`); a concrete class is built from its own fields."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Aggregator:
            return make_aggregator(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Aggregator(metaclass=_BuiltByName):
    """The interface every aggregator implements (see the module docstring). ``scale`` is the noise
    of the noisy max, in votes: the Laplace scale ``b`` (LNMax) or the Gaussian std ``σ``."""

    name: ClassVar[AggregatorName]
    default_scale: ClassVar[float]
    """The default ``scale`` per teacher (times K)."""
    has_data_dependent_analysis: ClassVar[bool] = True
    scale: float

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_settings(
        cls,
        scale: float | None,
        threshold: float | None = None,
        sigma1: float | None = None,
        num_teachers: int | None = None,
    ) -> Aggregator:
        """Build from the configured values; a None takes its default for ``num_teachers`` teachers."""
        if threshold is not None or sigma1 is not None:
            raise InvalidParameterError(
                "threshold",
                threshold,
                f"{cls.name} has no threshold check; a threshold here would be silently ignored",
                "drop threshold/sigma1, or use aggregator='confident-gnmax'",
            )
        if scale is None and num_teachers is not None:
            scale = cls.default_scale * num_teachers
        return cls(_check_positive("scale", scale, "the noise scale"))  # type: ignore[call-arg]

    # -- answering -----------------------------------------------------------------------------
    @abstractmethod
    def answer(self, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
        """Answer one query on the vote histogram ``counts``: the label and the events spent."""

    @abstractmethod
    def answer_event(self, secure: bool) -> PrivacyEvent:
        """The event of one answer (the noisy max)."""

    def query_events(self, secure: bool) -> tuple[PrivacyEvent, ...]:
        """Every event one query may spend (its worst case), in the order answering spends them."""
        return (self.answer_event(secure),)

    def answer_lattice(self, secure: bool) -> float:
        """The secure lattice of the noisy max in votes (0 in seeded mode)."""
        return min(1.0, lattice_spacing(self.scale, 1.0)) if secure else 0.0

    def noise_settings(self) -> dict[str, float | None]:
        """The noise parameters as the report names them."""
        return {"sigma": self.scale}

    def accountant_used(self, configured: Literal["pld", "rdp"]) -> Literal["pld", "rdp"]:
        """The accountant that composes this aggregator's events (Gaussian ones: RDP, always)."""
        return "rdp"

    # -- data-independent analysis ---------------------------------------------------------------
    def epsilon_of(
        self, spent: EventTally, delta: float, accountant: Literal["pld", "rdp"], release_rdp: np.ndarray
    ) -> float:
        """ε(δ) of the events spent plus a release's RDP curve. The Gaussian aggregators are
        composed in RDP (their costs are linear in α)."""
        return rdp_epsilon(spent.rdp() + release_rdp, delta)

    def data_independent_budget(
        self,
        target: float,
        delta: float,
        accountant: Literal["pld", "rdp"],
        release_rdp: np.ndarray,
        most: int,
        secure: bool,
    ) -> DataIndependentBudget:
        """The rule that keeps every path within ``target`` (answers counted in advance);
        raises :class:`~veil.errors.UnreachableTargetError` if not even one query fits."""
        event = self.answer_event(secure)

        def fits(n: int) -> bool:
            return self.epsilon_of(EventTally.of([(event, n)]), delta, accountant, release_rdp) <= target

        n = largest(fits, most)
        if n == 0:
            raise too_small(target, self._too_small_why())
        return AnswerCap(self, event, n, delta, accountant, release_rdp)

    def _too_small_why(self) -> str:
        return f"one {self.name} answer with scale {self.scale:g} plus the ε release exceeds it"

    # -- data-dependent analysis -----------------------------------------------------------------
    def account_data_dependent(
        self, account: DataDependentAccount, counts: np.ndarray, answer: Answer, secure: bool
    ) -> None:
        """Add one query's data-dependent cost (read from the events ``answer`` spent)."""
        if answer.label is not None:
            event = answer.events[-1]
            assert isinstance(event, Gaussian)
            account.add_gnmax(counts, self.scale, event.noise_multiplier, self.answer_lattice(secure))


@dataclass(frozen=True)
class LNMax(Aggregator):
    """``argmax_j n_j + Lap(b)``, ``b = scale``; composed by the configured accountant."""

    scale: float
    name: ClassVar[AggregatorName] = "lnmax"
    default_scale: ClassVar[float] = 0.08
    has_data_dependent_analysis: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_positive("scale", self.scale, "the noise scale")

    def answer(self, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
        res = report_noisy_max(_check_histogram(counts), "laplace", self.scale, rng)
        return Answer(res.index, (res.event,))

    def answer_event(self, secure: bool) -> PrivacyEvent:
        return noisy_max_event("laplace", self.scale, secure=secure)

    def noise_settings(self) -> dict[str, float | None]:
        return {"laplace_scale": self.scale}

    def accountant_used(self, configured: Literal["pld", "rdp"]) -> Literal["pld", "rdp"]:
        return configured

    def epsilon_of(
        self, spent: EventTally, delta: float, accountant: Literal["pld", "rdp"], release_rdp: np.ndarray
    ) -> float:
        if np.any(release_rdp):
            raise InvalidParameterError(
                "release", "nonzero", "LNMax has no data-dependent release to pay for", "pass zeros"
            )
        return spent.epsilon(accountant, delta)

    def _too_small_why(self) -> str:
        return f"one LNMax answer with scale b={self.scale:g} alone exceeds it"

    def account_data_dependent(
        self, account: DataDependentAccount, counts: np.ndarray, answer: Answer, secure: bool
    ) -> None:
        raise InvalidParameterError(
            "aggregator",
            self.name,
            "LNMax has no data-dependent analysis",
            "use gnmax or confident-gnmax for a data-dependent ε",
        )


@dataclass(frozen=True)
class GNMax(Aggregator):
    """``argmax_j n_j + N(0, σ²)``, ``σ = scale``; composed in RDP."""

    scale: float
    name: ClassVar[AggregatorName] = "gnmax"
    default_scale: ClassVar[float] = 0.16

    def __post_init__(self) -> None:
        _check_positive("scale", self.scale, "the noise scale")

    def answer(self, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
        res = report_noisy_max(_check_histogram(counts), "gaussian", self.scale, rng)
        return Answer(res.index, (res.event,))

    def answer_event(self, secure: bool) -> PrivacyEvent:
        return noisy_max_event("gaussian", self.scale, secure=secure)

    def _too_small_why(self) -> str:
        return f"one GNMax answer with σ={self.scale:g} plus the ε release exceeds it"


@dataclass(frozen=True)
class ConfidentGNMax(Aggregator):
    """Answer with GNMax(σ₂ = ``scale``) only if ``max_j n_j + N(0, σ₁²) ≥ T``."""

    scale: float
    threshold: float
    sigma1: float
    name: ClassVar[AggregatorName] = "confident-gnmax"
    default_scale: ClassVar[float] = 0.16
    default_threshold: ClassVar[float] = 0.8
    default_sigma1: ClassVar[float] = 0.6

    def __post_init__(self) -> None:
        _check_positive("scale", self.scale, "the noise scale")
        _check_positive("sigma1", self.sigma1, "the threshold noise σ₁")
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(float(self.threshold)):
            raise InvalidParameterError(
                "threshold", self.threshold, "Confident-GNMax needs a finite threshold T", "pass T"
            )

    @classmethod
    def from_settings(
        cls,
        scale: float | None,
        threshold: float | None = None,
        sigma1: float | None = None,
        num_teachers: int | None = None,
    ) -> Aggregator:
        k = num_teachers
        scale = cls.default_scale * k if scale is None and k is not None else scale
        threshold = cls.default_threshold * k if threshold is None and k is not None else threshold
        sigma1 = cls.default_sigma1 * k if sigma1 is None and k is not None else sigma1
        if threshold is None:
            raise InvalidParameterError(
                "threshold", threshold, "Confident-GNMax needs a finite threshold T", "pass T"
            )
        return cls(
            _check_positive("scale", scale, "the noise scale"),
            threshold,
            _check_positive("sigma1", sigma1, "the threshold noise σ₁"),
        )

    def threshold_check(self, counts: np.ndarray, rng: RandomSource) -> tuple[bool, PrivacyEvent]:
        """Whether ``max_j n_j + N(0, σ₁²) ≥ T``, and the event of the check."""
        check = gaussian_mechanism(float(counts.max()), sensitivity=1.0, std=self.sigma1, rng=rng)
        return float(check.value) >= self.threshold, check.event

    def answer(self, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
        c = _check_histogram(counts)
        passed, check = self.threshold_check(c, rng)
        if not passed:
            return Answer(None, (check,))
        res = report_noisy_max(c, "gaussian", self.scale, rng)
        return Answer(res.index, (check, res.event))

    def answer_event(self, secure: bool) -> PrivacyEvent:
        return noisy_max_event("gaussian", self.scale, secure=secure)

    def threshold_event(self, secure: bool) -> Gaussian:
        """The event of one threshold check."""
        return gaussian_event(1.0, self.sigma1, coordinates=1, secure=secure)

    def query_events(self, secure: bool) -> tuple[PrivacyEvent, ...]:
        return (self.threshold_event(secure), self.answer_event(secure))

    def threshold_lattice(self, secure: bool) -> float:
        """The secure lattice of the threshold check in votes (0 in seeded mode)."""
        return lattice_spacing(float(self.sigma1), 1.0) if secure else 0.0

    def noise_settings(self) -> dict[str, float | None]:
        return {"sigma": self.scale, "threshold": self.threshold, "sigma1": self.sigma1}

    def data_independent_budget(
        self,
        target: float,
        delta: float,
        accountant: Literal["pld", "rdp"],
        release_rdp: np.ndarray,
        most: int,
        secure: bool,
    ) -> DataIndependentBudget:
        """A Rényi filter: which queries are answered depends on released outcomes, so the
        answers cannot be counted in advance; the cap on ρ can."""
        events = self.query_events(secure)
        rule = RenyiFilter(events, largest_rho(release_rdp, target, delta), delta, release_rdp, most)
        if not rule.allows_another(EventTally()):
            raise too_small(
                target,
                f"one Confident-GNMax query (σ₁={self.sigma1:g}, σ₂={self.scale:g}) plus the ε release "
                "exceeds it",
            )
        return rule

    def account_data_dependent(
        self, account: DataDependentAccount, counts: np.ndarray, answer: Answer, secure: bool
    ) -> None:
        check = answer.events[0]
        assert isinstance(check, Gaussian)
        lattice = self.threshold_lattice(secure)
        account.add_threshold(int(counts.max()), self.threshold, self.sigma1, check.noise_multiplier, lattice)
        super().account_data_dependent(account, counts, answer, secure)


_BY_NAME: dict[str, type[Aggregator]] = {cls.name: cls for cls in (LNMax, GNMax, ConfidentGNMax)}


def aggregator_class(name: str) -> type[Aggregator]:
    """The aggregator class called ``name``; refuses a name without a privacy analysis."""
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidParameterError(
            "aggregator",
            name,
            "only LNMax, GNMax and Confident-GNMax have a privacy analysis here",
            f"use one of {', '.join(AGGREGATORS)}",
        )
    return cls


def make_aggregator(
    name: str,
    scale: float | None,
    threshold: float | None = None,
    sigma1: float | None = None,
    num_teachers: int | None = None,
) -> Aggregator:
    """The aggregator ``name`` with these settings (a None takes its default for ``num_teachers``:
    LNMax ``b = 0.08·K``, GNMax ``σ = 0.16·K``, Confident-GNMax ``σ₂ = 0.16·K, T = 0.8·K,
    σ₁ = 0.6·K``). ``Aggregator(name, scale, ...)`` calls this."""
    return aggregator_class(name).from_settings(scale, threshold, sigma1, num_teachers)


def answer_query(agg: Aggregator, counts: np.ndarray | list[int], rng: RandomSource) -> Answer:
    """Answer one query with ``agg`` on the vote histogram ``counts``."""
    return agg.answer(counts, rng)
