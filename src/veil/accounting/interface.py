"""The accountant interface shared by every accountant (``base.make_accountant`` builds one).

An accountant composes :mod:`~veil.accounting.events` and answers ``epsilon(delta)`` and
``delta(epsilon)`` for the composition. Contract (checked by one test that every accountant
passes):

* an empty accountant reports ε = 0 and δ = 0;
* composing :class:`~veil.accounting.events.NonPrivate` makes ε = ∞ (δ = 1);
* an unsupported event raises :class:`~veil.errors.UnsupportedEventError` naming it, and leaves
  the accountant exactly as it was (checks run before any state changes);
* results are conservative: rounding can only raise ε, never lower it;
* ``ledger`` (a :class:`~veil.accounting.events.Composed`) lists what was composed, JSON round-trips.
"""

from __future__ import annotations

import abc
import math
from typing import Literal

from veil.accounting.events import (
    Composed,
    Neighbouring,
    NonPrivate,
    NoOp,
    PoissonSampled,
    PrivacyEvent,
    SelfComposed,
)
from veil.errors import InvalidParameterError, UnsupportedEventError

AccountantName = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[AccountantName, ...] = ("pld", "rdp")


def check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (0 < delta < 1):
        raise InvalidParameterError(
            "delta",
            delta,
            "δ is the probability the ε guarantee fails and must lie in (0, 1)",
            "pass a δ well below 1/N, e.g. 1e-5",
        )
    return float(delta)


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or math.isnan(epsilon):
        raise InvalidParameterError(name, epsilon, "ε must be a number", "pass ε ≥ 0")
    if epsilon < 0:
        raise InvalidParameterError(
            name, epsilon, "ε measures privacy loss and cannot be negative", "pass ε ≥ 0"
        )
    return float(epsilon)


class PrivacyAccountant(abc.ABC):
    """Composes privacy events; answers ε for a δ and δ for an ε."""

    name: AccountantName

    def __init__(self, neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE) -> None:
        self.neighbouring = Neighbouring(neighbouring)
        self._events: list[PrivacyEvent] = []

    # -- composition -------------------------------------------------------------------------
    def supports(self, event: PrivacyEvent) -> bool:
        """Pure check: can this accountant account for ``event`` under its relation?"""
        return self._unsupported_part(event) is None

    def compose(self, event: PrivacyEvent, count: int = 1) -> PrivacyAccountant:
        """Compose ``event`` ``count`` times; returns ``self``. Refusals change nothing."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidParameterError(
                "count", count, "a composition count is a number of releases", "pass an integer ≥ 0"
            )
        bad = self._unsupported_part(event)
        if bad is not None:
            raise UnsupportedEventError(
                "event",
                type(bad).__name__,
                f"the {self.name} accountant cannot bound its privacy loss under "
                f"{self.neighbouring.value} ({bad.to_json()})",
                getattr(bad, "refusal_fix", None)
                or "use an accountant that supports it (see docs/accounting.md) or a supported mechanism",
            )
        if count == 0:
            return self
        composed = event if count == 1 else SelfComposed(event, count)
        self._add(composed)  # subclasses must not fail past this point
        self._events.append(composed)
        return self

    @property
    def ledger(self) -> Composed:
        """Everything composed so far, as one event."""
        return Composed(self._events)

    def _unsupported_part(self, event: PrivacyEvent) -> PrivacyEvent | None:
        """The first sub-event that cannot be accounted, or None."""
        if isinstance(event, (NoOp, NonPrivate)):
            return None
        if not event.supports_relation(self.neighbouring):
            return event
        if isinstance(event, SelfComposed):
            return self._unsupported_part(event.event)
        if isinstance(event, PoissonSampled) and not self._supports_leaf(event.event):
            return self._unsupported_part(event.event) or event
        if isinstance(event, Composed):
            for e in event.events:
                bad = self._unsupported_part(e)
                if bad is not None:
                    return bad
            return None
        return None if self._supports_leaf(event) else event

    @abc.abstractmethod
    def _supports_leaf(self, event: PrivacyEvent) -> bool: ...

    @abc.abstractmethod
    def _add(self, event: PrivacyEvent) -> None:
        """Fold an already-validated event into the state."""

    # -- queries -----------------------------------------------------------------------------
    @abc.abstractmethod
    def epsilon(self, delta: float) -> float:
        """The smallest ε (rounded up) such that the composition is (ε, δ)-DP."""

    @abc.abstractmethod
    def delta(self, epsilon: float) -> float:
        """The smallest δ (rounded up) such that the composition is (ε, δ)-DP."""

    # -- Opacus's names (see veil.accountants) ---------------------------------------------------
    def get_epsilon(self, delta: float) -> float:
        """Opacus's name for :meth:`epsilon`: ``accountant.get_epsilon(delta=1e-5)``."""
        return self.epsilon(delta)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus's view of the composed DP-SGD steps: merged ``(noise_multiplier, sample_rate, steps)``."""
        from veil.accounting.history import dpsgd_history

        return list(dpsgd_history(self._events))
