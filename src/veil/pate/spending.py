"""What a labelling run spends, and the data-independent rules that bound it.

:class:`EventTally` counts the privacy events the aggregators' answers returned; every ε the
labelling loop reports is read from it. A :class:`DataIndependentBudget` is a stopping rule fixed
from public parameters before any vote is seen, with the worst-case ε it guarantees:
:class:`AnswerCap` (every answer costs the same event: count the answers that fit) and
:class:`RenyiFilter` (answers depend on released outcomes: cap the spent ρ, Feldman & Zrnic 2021).
Gaussian costs are composed in RDP at :data:`ORDERS`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from veil.accounting.base import make_accountant
from veil.accounting.events import Gaussian, PrivacyEvent
from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from veil.errors import UnreachableTargetError

__all__ = [
    "ORDERS",
    "AnswerCap",
    "DataIndependentBudget",
    "EventTally",
    "RenyiFilter",
    "SpentEpsilon",
    "largest",
    "largest_rho",
    "rdp_epsilon",
    "rdp_of",
    "rho_of",
    "too_small",
]

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
class SpentEpsilon(Protocol):
    """What :class:`AnswerCap` needs of its aggregator (:class:`veil.pate.aggregators.Aggregator`,
    which imports this module): the ε(δ) of the events spent plus a release's RDP curve."""

    def epsilon_of(
        self, spent: EventTally, delta: float, accountant: Literal["pld", "rdp"], release_rdp: np.ndarray
    ) -> float: ...


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

    aggregator: SpentEpsilon
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
