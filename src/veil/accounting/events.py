"""Privacy events: immutable, validated descriptions of what a mechanism did.

An event says *which* randomised computation touched the private data; it carries no data and no
state. Accountants (:mod:`veil.accounting.rdp`, :mod:`veil.accounting.pld`) compose events into an
(ε, δ) guarantee; the run ledger persists the same events, so a report can be re-verified later.

Normalisation. Every noise parameter is relative to the *sensitivity of the noised quantity under
the stated neighbouring relation*: :class:`Gaussian` with ``noise_multiplier=σ`` releases
``f(D) + N(0, σ²Δ²)`` where ``Δ`` is the L2 sensitivity of ``f``; :class:`Laplace` releases
``f(D) + Lap(b)`` with L1 sensitivity ``Δ`` (``scale=b``, ``sensitivity=Δ``).

Neighbouring relations (:class:`Neighbouring`):

* ``ADD_OR_REMOVE_ONE``: D' is D with one record added or removed (the unit DP-SGD with Poisson
  sampling is analysed in). For a clipped sum with clip norm C, Δ = C.
* ``REPLACE_ONE``: D' is D with one record replaced (same size). For a clipped sum, Δ = 2C.

Which relation an event supports is given by :meth:`PrivacyEvent.supports_relation`:
Gaussian/Laplace support both (their parameter is relative to the sensitivity under the relation
used); :class:`PoissonSampled` is analysed under add/remove only, since amplification by Poisson
sampling is a statement about the presence of one record.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from veil.errors import InvalidParameterError

__all__ = [
    "ApproximateDP",
    "Composed",
    "DeltaOnly",
    "ExponentialMechanism",
    "Gaussian",
    "Laplace",
    "Neighbouring",
    "NoOp",
    "NonPrivate",
    "OneOf",
    "PoissonSampled",
    "PrivacyEvent",
    "RepeatAndSelect",
    "SelfComposed",
    "ZeroConcentrated",
    "event_from_dict",
    "event_from_json",
]


class Neighbouring(str, enum.Enum):
    """The neighbouring relation a guarantee is stated for."""

    ADD_OR_REMOVE_ONE = "add_or_remove_one"
    REPLACE_ONE = "replace_one"


_BOTH = frozenset(Neighbouring)
_REGISTRY: dict[str, type[PrivacyEvent]] = {}


def _check_finite_positive(name: str, value: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(name, value, "it must be a real number to calibrate noise", fix)
    if not math.isfinite(value) or value <= 0:
        raise InvalidParameterError(
            name, value, "noise must have a finite positive scale or nothing is protected", fix
        )


@dataclass(frozen=True)
class PrivacyEvent:
    """Base class. Subclasses are frozen dataclasses validated in ``__post_init__``."""

    kind: ClassVar[str] = "event"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.kind] = cls

    def supports_relation(self, relation: Neighbouring) -> bool:
        """Whether this event's analysis holds under ``relation``."""
        return relation in _BOTH

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``"type"`` tag; inverse of :func:`event_from_dict`."""
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class NoOp(PrivacyEvent):
    """A computation that did not touch private data: costs nothing."""

    kind: ClassVar[str] = "noop"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind}


@dataclass(frozen=True)
class NonPrivate(PrivacyEvent):
    """A computation on private data with no guarantee: ε = ∞ once composed."""

    kind: ClassVar[str] = "non_private"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind}


@dataclass(frozen=True)
class Gaussian(PrivacyEvent):
    """Gaussian mechanism ``f(D) + N(0, σ²Δ²·I)`` with ``noise_multiplier = σ``."""

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        _check_finite_positive(
            "noise_multiplier",
            self.noise_multiplier,
            "pass σ > 0 (use NonPrivate for an un-noised release)",
        )
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "noise_multiplier": self.noise_multiplier}


@dataclass(frozen=True)
class Laplace(PrivacyEvent):
    """Laplace mechanism ``f(D) + Lap(scale)`` for L1 sensitivity ``sensitivity``: pure ε = Δ/b."""

    scale: float
    sensitivity: float = 1.0
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        _check_finite_positive("scale", self.scale, "pass a Laplace scale b > 0")
        _check_finite_positive("sensitivity", self.sensitivity, "pass the L1 sensitivity Δ > 0")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "sensitivity", float(self.sensitivity))

    @property
    def noise_multiplier(self) -> float:
        """Scale relative to sensitivity, b/Δ."""
        return self.scale / self.sensitivity

    @property
    def pure_epsilon(self) -> float:
        """The pure-DP ε = Δ/b of one release."""
        return self.sensitivity / self.scale

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "scale": self.scale, "sensitivity": self.sensitivity}


@dataclass(frozen=True)
class ExponentialMechanism(PrivacyEvent):
    """One selection by the exponential mechanism with parameter ``epsilon``.

    The mechanism picks candidate ``i`` with probability ∝ ``exp(ε·u_i/(2Δ))``, where ``Δ`` bounds
    how much any score ``u_i`` moves between neighbouring datasets (under the relation used). It is
    ε-DP and, more usefully for composition, ε-*bounded range* (every output's log-probability moves
    within an interval of width ε), hence ``ε²/8``-zCDP (Cesar & Rogers 2021, Lemma 3.2): Rényi
    divergence ``≤ α·ε²/8`` at every order α, and never above the pure-DP bound ε.
    """

    epsilon: float
    kind: ClassVar[str] = "exponential_mechanism"

    def __post_init__(self) -> None:
        _check_finite_positive("epsilon", self.epsilon, "pass the selection's ε > 0")
        object.__setattr__(self, "epsilon", float(self.epsilon))

    @property
    def rho(self) -> float:
        """The zCDP parameter ε²/8 of one selection (bounded range)."""
        return self.epsilon**2 / 8

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "epsilon": self.epsilon}


@dataclass(frozen=True)
class PoissonSampled(PrivacyEvent):
    """``event`` applied to a Poisson sample: each record joins independently with prob. q."""

    sampling_rate: float
    event: PrivacyEvent
    kind: ClassVar[str] = "poisson_sampled"

    def __post_init__(self) -> None:
        q = self.sampling_rate
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0 < q <= 1):
            raise InvalidParameterError(
                "sampling_rate",
                q,
                "amplification by sampling is defined only for a probability in (0, 1]",
                "pass q = expected batch size / dataset size",
            )
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidParameterError(
                "event", self.event, "only a privacy event can be sampled", "wrap a PrivacyEvent"
            )
        object.__setattr__(self, "sampling_rate", float(q))

    def supports_relation(self, relation: Neighbouring) -> bool:
        return relation is Neighbouring.ADD_OR_REMOVE_ONE and self.event.supports_relation(relation)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "sampling_rate": self.sampling_rate, "event": self.event.to_dict()}


@dataclass(frozen=True)
class SelfComposed(PrivacyEvent):
    """``event`` applied ``count`` times (adaptively) to the same data."""

    event: PrivacyEvent
    count: int
    kind: ClassVar[str] = "self_composed"

    def __post_init__(self) -> None:
        c = self.count
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidParameterError(
                "count", c, "a composition count is a number of releases", "pass an integer ≥ 0"
            )
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidParameterError(
                "event", self.event, "only a privacy event can be composed", "wrap a PrivacyEvent"
            )

    def supports_relation(self, relation: Neighbouring) -> bool:
        return self.event.supports_relation(relation)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "count": self.count, "event": self.event.to_dict()}


@dataclass(frozen=True)
class Composed(PrivacyEvent):
    """Adaptive composition of several (possibly different) events, in order."""

    events: tuple[PrivacyEvent, ...] = field(default_factory=tuple)
    kind: ClassVar[str] = "composed"

    def __init__(self, events: Iterable[PrivacyEvent] = ()) -> None:
        evs = tuple(events)
        for e in evs:
            if not isinstance(e, PrivacyEvent):
                raise InvalidParameterError(
                    "events", e, "only privacy events can be composed", "pass PrivacyEvent objects"
                )
        object.__setattr__(self, "events", evs)

    def supports_relation(self, relation: Neighbouring) -> bool:
        return all(e.supports_relation(relation) for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "events": [e.to_dict() for e in self.events]}


# -- events that only some accountants (or only the budget registry) can bound -------------------


@dataclass(frozen=True)
class ZeroConcentrated(PrivacyEvent):
    """A release known only to be ``rho``-zCDP: Rényi divergence ``≤ α·ρ`` at every order α > 1.

    What a job reserves when it knows its zCDP budget but not yet its events (``veil synth``: AIM's
    selections and measurements are chosen adaptively, their ρ summing to at most the budget). The
    RDP accountant bounds it; the PLD accountant refuses it, since zCDP does not determine a
    privacy-loss distribution (a Gaussian of the same ρ would *under*-state some ρ-zCDP mechanisms).
    """

    rho: float
    kind: ClassVar[str] = "zcdp"
    refusal_fix: ClassVar[str] = (
        "zCDP bounds Rényi divergences only: "
        "compose it in RDP (veil.accounting.tuning.events_rdp), as the budget registry does"
    )

    def __post_init__(self) -> None:
        _check_finite_positive("rho", self.rho, "pass the zCDP budget ρ > 0")
        object.__setattr__(self, "rho", float(self.rho))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "rho": self.rho}


@dataclass(frozen=True)
class DeltaOnly(PrivacyEvent):
    """The ``(0, δ)`` part of a release: it behaves like the events beside it except, with probability
    at most ``delta`` under the dataset that holds the record, it reveals more.

    Example: a thresholded noisy histogram (``veil schema infer --epsilon``). Its noisy counts are a
    Laplace event; a value that only the added record holds is released with probability ≤ δ, and
    otherwise the output has exactly the law it has without the record. For any composition of such
    releases with other events, ``δ_total(ε) ≤ δ_events(ε) + Σ δ_i`` in both directions of the
    add/remove relation (the mixture ``(1 − s)·M̃ + s·R`` with ``s ≤ Σ δ_i`` costs at most ``s``
    in the hockey-stick divergence, whichever side it is on). No accountant composes it: the budget
    registry (:mod:`veil.registry.compose`) states ε at ``δ − Σ δ_i``.
    """

    delta: float
    kind: ClassVar[str] = "delta_only"
    refusal_fix: ClassVar[str] = (
        "its δ adds to the total's δ: the budget registry composes it (veil.registry.compose.spent_epsilon)"
    )

    def __post_init__(self) -> None:
        d = self.delta
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 < d < 1):
            raise InvalidParameterError(
                "delta", d, "a failure probability lies in (0, 1)", "pass the release's δ, e.g. 1e-7"
            )
        object.__setattr__(self, "delta", float(d))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "delta": self.delta}


@dataclass(frozen=True)
class ApproximateDP(PrivacyEvent):
    """A release known only through an ``(epsilon, delta)``-DP guarantee at one δ.

    For analyses that end in one (ε, δ) statement rather than in events: PATE's Propose-Test-Release
    and data-independent label budgets (``veil pate``). Every (ε, δ)-DP pair of output laws is a
    post-processing of the (ε, δ) randomized response (Kairouz, Oh & Viswanath 2015): with probability
    δ an output that reveals everything, else randomized response RR(ε). So it composes as a
    :class:`DeltaOnly` part ``delta`` plus an ε-DP part, whose Rényi divergence at every order is at
    most RR(ε)'s (RDP does not grow under post-processing). The budget registry composes it so; the
    accountants refuse it.
    """

    epsilon: float
    delta: float = 0.0
    kind: ClassVar[str] = "approximate_dp"
    refusal_fix: ClassVar[str] = (
        "its δ adds to the total's δ and its ε part composes as randomized response: "
        "the budget registry composes it (veil.registry.compose.spent_epsilon)"
    )

    def __post_init__(self) -> None:
        e, d = self.epsilon, self.delta
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not (math.isfinite(e) and e >= 0):
            raise InvalidParameterError("epsilon", e, "a guarantee's ε is a finite number ≥ 0", "pass ε ≥ 0")
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 <= d < 1):
            raise InvalidParameterError(
                "delta", d, "a guarantee's δ lies in [0, 1)", "pass the δ it holds at"
            )
        object.__setattr__(self, "epsilon", float(e))
        object.__setattr__(self, "delta", float(d))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "epsilon": self.epsilon, "delta": self.delta}


@dataclass(frozen=True)
class OneOf(PrivacyEvent):
    """One of ``events``, chosen at random independently of the data (the choice may be released).

    Its Rényi divergence at every order is at most the largest of the events' (``e^{(α−1)D_α}`` of
    the mixture is the choice-weighted mean of the events'), which is how the RDP accountant bounds
    it. ``veil tune`` uses it for one trial: the trial's shape is drawn from the search space.
    """

    events: tuple[PrivacyEvent, ...] = field(default_factory=tuple)
    kind: ClassVar[str] = "one_of"
    refusal_fix: ClassVar[str] = (
        "the largest of several curves is an RDP statement: "
        "compose it in RDP (veil.accounting.tuning.events_rdp), as the budget registry does"
    )

    def __init__(self, events: Iterable[PrivacyEvent] = ()) -> None:
        evs = tuple(events)
        if not evs or not all(isinstance(e, PrivacyEvent) for e in evs):
            raise InvalidParameterError(
                "events", evs, "a choice needs at least one privacy event", "pass PrivacyEvent objects"
            )
        object.__setattr__(self, "events", evs)

    def supports_relation(self, relation: Neighbouring) -> bool:
        return all(e.supports_relation(relation) for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class RepeatAndSelect(PrivacyEvent):
    """``event`` run K times, K drawn independently of the data, and only the best run released.

    Private hyperparameter tuning by random stopping (Papernot & Steinke, ICLR 2022); the same event
    as dp-accounting's ``RepeatAndSelectDpEvent``. The law of K: ``"negative_binomial"`` truncated at
    K ≥ 1 with shape η = ``shape`` ≥ 0 (η = 0 logarithmic, η = 1 geometric) and ``mean`` ≥ 1, or
    ``"poisson"`` (``mean`` > 0; ``shape`` unused). The RDP accountant bounds it through
    :mod:`veil.accounting.tuning`; the PLD accountant refuses it (the bound is a statement about
    Rényi divergences, not about a privacy-loss distribution).
    """

    event: PrivacyEvent
    mean: float
    law: str = "negative_binomial"
    shape: float = 1.0
    kind: ClassVar[str] = "repeat_and_select"
    refusal_fix: ClassVar[str] = (
        "the Papernot–Steinke bound is a statement about Rényi divergences, not a loss distribution: "
        "compose it in RDP (veil.accounting.tuning.events_rdp), as the budget registry does"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.event, PrivacyEvent):
            raise InvalidParameterError(
                "event", self.event, "only a privacy event can be repeated", "wrap a PrivacyEvent"
            )
        if self.law not in ("negative_binomial", "poisson"):
            raise InvalidParameterError(
                "law",
                self.law,
                "the tuning bound is proved only for these laws",
                "negative_binomial or poisson",
            )
        nb = self.law == "negative_binomial"
        m = self.mean
        if (
            isinstance(m, bool)
            or not isinstance(m, (int, float))
            or not math.isfinite(m)
            or (m < 1 if nb else m <= 0)
        ):
            raise InvalidParameterError(
                "mean",
                m,
                "the mean number of runs sets the bound's log E[K] term",
                "pass a finite mean (≥ 1 for the negative binomial, > 0 for Poisson)",
            )
        s = self.shape
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s >= 0):
            raise InvalidParameterError("shape", s, "the negative binomial needs a shape η ≥ 0", "pass η ≥ 0")
        object.__setattr__(self, "mean", float(m))
        object.__setattr__(self, "shape", float(s))

    def supports_relation(self, relation: Neighbouring) -> bool:
        return self.event.supports_relation(relation)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "event": self.event.to_dict(),
            "mean": self.mean,
            "law": self.law,
            "shape": self.shape,
        }


def event_from_dict(data: dict[str, Any]) -> PrivacyEvent:
    """Rebuild an event from :meth:`PrivacyEvent.to_dict` output (validated again)."""
    if not isinstance(data, dict) or "type" not in data:
        raise InvalidParameterError(
            "event", data, "an event record must name its type", "pass the output of to_dict()"
        )
    kind = data["type"]
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise InvalidParameterError(
            "event.type", kind, "an unknown event cannot be accounted", f"use one of {sorted(_REGISTRY)}"
        )
    fields = {k: v for k, v in data.items() if k != "type"}
    if "event" in fields:
        fields["event"] = event_from_dict(fields["event"])
    if "events" in fields:
        events = [event_from_dict(e) for e in fields["events"]]
        return OneOf(events) if cls is OneOf else Composed(events)
    return cls(**fields)


def event_from_json(text: str) -> PrivacyEvent:
    return event_from_dict(json.loads(text))
