"""Noisy aggregation of teacher votes: LNMax, GNMax and Confident-GNMax, one small object each.

Every aggregator has the same interface:

* :meth:`Aggregator.answer` answers one query from its vote histogram (one count per class,
  summing to the number of teachers) and returns the label and the privacy events it spent, so
  the caller's accountant composes exactly what was run;
* the data-independent analysis: :meth:`Aggregator.query_events` (the worst case of one query),
  :meth:`Aggregator.epsilon_of` (the ε of the events spent, read from an :class:`EventTally`) and
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
from abc import ABC, ABCMeta, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from veil.accounting.base import make_accountant
from veil.accounting.events import Gaussian, PrivacyEvent
from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from veil.errors import InvalidParameterError, UnreachableTargetError
from veil.mechanisms import (
    gaussian_event,
    gaussian_mechanism,
    lattice_spacing,
    noisy_max_event,
    report_noisy_max,
)
from veil.mechanisms.rng import RandomSource

if TYPE_CHECKING:
    from veil.pate.smooth_sensitivity import DataDependentAccount

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "AggregatorName",
    "Answer",
    "AnswerCap",
    "ConfidentGNMax",
    "DataIndependentBudget",
    "EventTally",
    "GNMax",
    "LNMax",
    "RenyiFilter",
    "answer_query",
    "make_aggregator",
]

AggregatorName = Literal["lnmax", "gnmax", "confident-gnmax"]
AGGREGATORS: tuple[AggregatorName, ...] = ("lnmax", "gnmax", "confident-gnmax")
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
"""The Rényi orders of every RDP curve here."""


def rdp_of(event: PrivacyEvent) -> np.ndarray:
    """The RDP curve of one event at :data:`ORDERS`."""
    acc = make_accountant("rdp")
    acc.compose(event)
    return np.asarray(acc.rdp)  # type: ignore[attr-defined]


def rdp_epsilon(rdp: np.ndarray, delta: float) -> float:
    """ε(δ) of an RDP curve at :data:`ORDERS` (tight conversion)."""
    return rdp_to_epsilon(DEFAULT_ORDERS, rdp, delta)


def rho_of(event: PrivacyEvent) -> float:
    """``ρ`` with RDP ``α·ρ`` at every order: ``1/(2σ²)`` for a Gaussian event, else ∞ (no such ρ)."""
    return 1.0 / (2.0 * event.noise_multiplier**2) if isinstance(event, Gaussian) else math.inf


class EventTally:
    """The privacy events that answering returned, counted per event (in first-seen order).

    The budget analyses read this, never a count kept by hand. ``rho`` is the running sum of
    :func:`rho_of` over every event added, in order (Gaussian aggregators only).
    """

    def __init__(self) -> None:
        self._counts: dict[PrivacyEvent, int] = {}
        self.rho = 0.0

    @classmethod
    def of(cls, events: Iterable[tuple[PrivacyEvent, int]]) -> EventTally:
        """A tally holding ``count`` of each ``(event, count)`` (a hypothetical path, for planning)."""
        tally = cls()
        for event, count in events:
            tally._counts[event] = tally._counts.get(event, 0) + count
            tally.rho += count * rho_of(event)
        return tally

    def add(self, events: Iterable[PrivacyEvent]) -> None:
        for event in events:
            self._counts[event] = self._counts.get(event, 0) + 1
            self.rho += rho_of(event)

    def count(self, event: PrivacyEvent) -> int:
        return self._counts.get(event, 0)

    def __iter__(self) -> Iterator[tuple[PrivacyEvent, int]]:
        return iter(self._counts.items())

    def rdp(self) -> np.ndarray:
        """The composed RDP curve of every event spent."""
        total = np.zeros_like(ORDERS)
        for event, count in self:
            total = total + count * rdp_of(event)
        return total

    def epsilon(self, accountant: Literal["pld", "rdp"], delta: float) -> float:
        """ε(δ) of every event spent, composed by ``accountant``."""
        acc = make_accountant(accountant)
        for event, count in self:
            acc.compose(event, count)
        return acc.epsilon(delta)


def largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with ok(n) (ok monotone, ok(0) assumed true)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_rho(release: np.ndarray, target: float, delta: float) -> float:
    """The largest ρ with ε(α·ρ + release(α)) ≤ target (bisection, kept on the feasible side)."""
    if rdp_epsilon(release, delta) > target:
        return 0.0
    lo, hi = 0.0, 1.0
    while rdp_epsilon(ORDERS * hi + release, delta) <= target:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return lo
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if rdp_epsilon(ORDERS * mid + release, delta) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def too_small(target: float, why: str) -> UnreachableTargetError:
    """The error of a target ε that cannot pay for one query."""
    return UnreachableTargetError(
        "epsilon",
        target,
        f"the budget is too small to answer even one query ({why})",
        "raise ε, or raise the aggregator's noise (fewer, noisier answers), or lower the release cost",
    )


# -- data-independent budgets -------------------------------------------------------------------
class DataIndependentBudget(ABC):
    """A stopping rule fixed from public parameters, and the worst-case ε it guarantees."""

    max_answers: int
    rho_max: float

    @abstractmethod
    def allows_another(self, spent: EventTally) -> bool:
        """Whether the next query may be asked, given the events spent so far."""

    @abstractmethod
    def epsilon(self, spent: EventTally, queries: int) -> float:
        """The data-independent ε of the run that spent ``spent`` (``queries``: most queries planned)."""


@dataclass(frozen=True)
class AnswerCap(DataIndependentBudget):
    """LNMax, GNMax: every answer spends the same event, so the answers that fit the target are
    counted in advance; the guarantee is the ε of the events spent (plus the release)."""

    aggregator: Aggregator
    event: PrivacyEvent
    max_answers: int
    delta: float
    accountant: Literal["pld", "rdp"]
    release_rdp: np.ndarray
    rho_max: float = math.inf

    def allows_another(self, spent: EventTally) -> bool:
        return spent.count(self.event) < self.max_answers

    def epsilon(self, spent: EventTally, queries: int) -> float:
        return self.aggregator.epsilon_of(spent, self.delta, self.accountant, self.release_rdp)


@dataclass(frozen=True)
class RenyiFilter(DataIndependentBudget):
    """Confident-GNMax: a Rényi filter (Feldman & Zrnic 2021). A query is asked only if
    ``ρ_spent + Σ ρ(worst-case query events) ≤ ρ_max``; every cost is linear in α, so the filter
    holds at every order at once and the run is ``(α, α·min(ρ_max, Q·ρ_query) + release(α))``-RDP."""

    query_events: tuple[PrivacyEvent, ...]
    rho_max: float
    delta: float
    release_rdp: np.ndarray
    max_answers: int = 0

    def allows_another(self, spent: EventTally) -> bool:
        worst = spent.rho
        for event in self.query_events:
            worst += rho_of(event)
        return worst <= self.rho_max

    def epsilon(self, spent: EventTally, queries: int) -> float:
        rho_query = sum((rho_of(e) for e in self.query_events), 0.0)
        return rdp_epsilon(ORDERS * min(self.rho_max, queries * rho_query) + self.release_rdp, self.delta)


# -- the aggregators --------------------------------------------------------------------------------
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
