"""Privacy of private hyperparameter tuning by random stopping (Papernot & Steinke, ICLR 2022).

A tuning procedure runs a randomised trial ``Q`` (here: one DP training run plus its DP validation
score) ``K`` times, ``K`` drawn at random *independently of the data*, and releases only the best
candidate by its noisy score. Releasing the best of a *fixed* number of runs can cost as much as all
of them; a random ``K`` from the distributions below costs a small constant over one trial.

Guarantee. If one trial is (λ, ε(λ))-RDP at every order λ of the grid (add/remove-one neighbouring,
the trial's events composed by :class:`~veil.accounting.rdp.RDPAccountant`), the released output of
the whole procedure (the selected trial's outputs and score, and which trial it was) is
(λ, ε'(λ))-RDP with

* ``K`` ~ truncated negative binomial(η, γ) (η = 0 the logarithmic, η = 1 the geometric law),
  Theorem 2 of the paper, for every λ > 1 and every λ̂ ≥ 1 of the grid::

      ε'(λ) = ε(λ) + (1 + η)(1 − 1/λ̂) ε(λ̂) + (1 + η) log(1/γ)/λ̂ + log E[K]/(λ − 1)

  (minimised over λ̂);
* ``K`` ~ Poisson(μ) (``K = 0`` releases nothing), Theorem 6: with δ̂ the δ of one trial at
  ε̂ = log(1 + 1/(λ − 1)) (from its RDP curve)::

      ε'(λ) = ε(λ) + μ δ̂ + log μ/(λ − 1).

RDP is non-decreasing in λ, so each order's bound is also lowered to the smallest bound of a higher
order. The total (ε, δ) comes from the same RDP → (ε, δ) conversion as every other veil run. The
number of trials must be drawn exactly from the stated law (:meth:`TrialCount.sample`, OS CSPRNG):
capping it, or stopping on a good score, voids the bound. Several outputs of the trials (e.g. every
trial's score) are *not* covered: only the selected candidate is released.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.accounting.events import (
    ApproximateDP,
    Composed,
    Neighbouring,
    OneOf,
    PrivacyEvent,
    RepeatAndSelect,
    SelfComposed,
    ZeroConcentrated,
)
from veil.accounting.rdp import DEFAULT_ORDERS, RDPAccountant, rdp_to_delta, rdp_to_epsilon
from veil.errors import InvalidParameterError

__all__ = [
    "TrialCount",
    "events_rdp",
    "pure_dp_rdp",
    "repeat_and_select",
    "trial_rdp",
    "tuning_epsilon",
    "tuning_rdp",
]

Law = Literal["negative_binomial", "poisson"]


@dataclass(frozen=True)
class TrialCount:
    """The law of the number of trials: ``negative_binomial`` (shape η ≥ 0, truncated at K ≥ 1) or
    ``poisson`` (K ≥ 0), given by its mean (≥ 1 for both laws, as dp-accounting requires too)."""

    mean: float
    law: Law = "negative_binomial"
    shape: float = 1.0

    def __post_init__(self) -> None:
        if self.law not in ("negative_binomial", "poisson"):
            raise InvalidParameterError(
                "trial_law", self.law, "the tuning bound is proved only for these laws", "pass one of them"
            )
        if not (math.isfinite(self.mean) and self.mean >= 1):
            # Below 1 the log E[K] term turns negative and the bound can fall under 0, which no
            # divergence can: the theorem is applied (here as in dp-accounting) only from a mean of 1.
            raise InvalidParameterError(
                "trials_mean",
                self.mean,
                "the random-stopping bound holds for a mean number of trials of at least 1 (below it "
                "the bound's log E[K] term is negative)",
                "pass e.g. --trials-mean 4",
            )
        if self.law == "negative_binomial" and not (math.isfinite(self.shape) and self.shape >= 0):
            raise InvalidParameterError(
                "trials_shape",
                self.shape,
                "the truncated negative binomial needs a shape η ≥ 0",
                "pass η ≥ 0",
            )

    # -- the truncated negative binomial's γ from its mean ---------------------------------------
    def _mean_of_gamma(self, gamma: float) -> float:
        eta = self.shape
        if eta == 0:
            return (1 - gamma) / (gamma * math.log(1 / gamma))
        return eta * (1 - gamma) / (gamma * (1 - gamma**eta))

    @property
    def gamma(self) -> float:
        """γ ∈ (0, 1] of the truncated negative binomial with this mean (1: always one trial)."""
        if self.law != "negative_binomial":
            raise InvalidParameterError("trial_law", self.law, "γ belongs to the negative binomial", "-")
        if self.mean == 1.0:
            return 1.0
        lo, hi = 1e-300, 1 - 1e-15  # the mean falls from +inf to 1 as γ goes from 0 to 1
        for _ in range(200):
            mid = math.sqrt(lo * hi) if hi / lo > 4 else (lo + hi) / 2
            if self._mean_of_gamma(mid) > self.mean:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.law == "poisson":
            return math.exp(k * math.log(self.mean) - self.mean - math.lgamma(k + 1)) if k >= 0 else 0.0
        if k < 1:
            return 0.0
        g, eta = self.gamma, self.shape
        if g == 1.0:
            return 1.0 if k == 1 else 0.0
        if eta == 0:
            return (1 - g) ** k / (k * math.log(1 / g))
        log_prod = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(k * math.log1p(-g) + log_prod) / (g**-eta - 1)

    def sample(self) -> int:
        """One draw of K by inversion, the uniform from the OS CSPRNG (never a seeded generator)."""
        u = secrets.randbits(53) / 2.0**53
        k = 0 if self.law == "poisson" else 1
        cdf = self.pmf(k)
        while cdf <= u and k < 10**7:
            k += 1
            cdf += self.pmf(k)
        return k


def trial_rdp(events: Sequence[PrivacyEvent], orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP curve of one trial: its events composed by veil's RDP accountant (add/remove-one)."""
    acc = RDPAccountant(orders=orders)
    for e in events:
        acc.compose(e)
    return np.asarray(acc.rdp, dtype=float)


def tuning_rdp(orders: Sequence[float], rdp: Sequence[float] | np.ndarray, count: TrialCount) -> np.ndarray:
    """RDP of the whole random-stopping procedure from one trial's curve (module docstring)."""
    a = np.asarray(orders, dtype=float)
    r = np.asarray(rdp, dtype=float)
    out = np.full(len(a), np.inf)
    valid = a > 1
    if count.law == "poisson":
        for i in np.flatnonzero(valid):
            eps_hat = math.log1p(1 / (a[i] - 1))
            delta_hat = rdp_to_delta(orders, r, eps_hat)
            out[i] = r[i] + count.mean * delta_hat + math.log(count.mean) / (a[i] - 1)
    else:
        eta, gamma = count.shape, count.gamma
        with np.errstate(invalid="ignore"):
            hat = (1 - 1 / a) * r + math.log(1 / gamma) / a
        const = (1 + eta) * float(np.min(np.where(a >= 1, hat, np.inf)))
        out[valid] = r[valid] + math.log(count.mean) / (a[valid] - 1) + const
    # Monotonicity in λ: the bound at λ also holds at every smaller order.
    return np.minimum.accumulate(out[::-1])[::-1]


def tuning_epsilon(
    trial_events: Sequence[PrivacyEvent],
    delta: float,
    count: TrialCount,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """ε at ``delta`` of the whole tuning procedure (every trial counted, not the best one's ε)."""
    return rdp_to_epsilon(orders, tuning_rdp(orders, trial_rdp(trial_events, orders), count), delta)


# -- the whole tuning procedure as one event ----------------------------------------------------


def repeat_and_select(trial: PrivacyEvent, count: TrialCount) -> RepeatAndSelect:
    """The event of a whole random-stopping tuning run whose trials are each ``trial``."""
    return RepeatAndSelect(trial, count.mean, count.law, count.shape)


def pure_dp_rdp(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of randomized response RR(ε) at each order: the largest of any ε-DP mechanism.

    ``D_α = log(p^α (1−p)^{1−α} + (1−p)^α p^{1−α}) / (α − 1)`` with ``p = e^ε/(1 + e^ε)``, in log space.
    """
    a = np.asarray(orders, dtype=float)
    if epsilon == 0:
        return np.zeros(len(a))
    lp, lq = -math.log1p(math.exp(-epsilon)), -math.log1p(math.exp(epsilon))
    d = np.logaddexp(a * lp + (1 - a) * lq, a * lq + (1 - a) * lp) / (a - 1)
    return np.minimum(d, epsilon)


def _needs_this_module(event: PrivacyEvent) -> bool:
    if isinstance(event, (RepeatAndSelect, OneOf, ZeroConcentrated)):
        return True
    if isinstance(event, ApproximateDP):
        return event.delta == 0
    if isinstance(event, SelfComposed):
        return _needs_this_module(event.event)
    if isinstance(event, Composed):
        return any(_needs_this_module(e) for e in event.events)
    return False


def _event_rdp(event: PrivacyEvent, orders: Sequence[float], relation: Neighbouring) -> np.ndarray:
    if isinstance(event, RepeatAndSelect):
        inner = _event_rdp(event.event, orders, relation)
        count = TrialCount(event.mean, event.law, event.shape)  # type: ignore[arg-type]
        return tuning_rdp(orders, inner, count)
    if isinstance(event, OneOf):
        return np.max([_event_rdp(e, orders, relation) for e in event.events], axis=0)
    if isinstance(event, ZeroConcentrated):
        return np.asarray(orders, dtype=float) * event.rho
    if isinstance(event, ApproximateDP) and event.delta == 0:
        return pure_dp_rdp(event.epsilon, orders)
    if isinstance(event, SelfComposed) and _needs_this_module(event.event):
        return (
            event.count * _event_rdp(event.event, orders, relation) if event.count else np.zeros(len(orders))
        )
    if isinstance(event, Composed) and _needs_this_module(event):
        return np.sum([_event_rdp(e, orders, relation) for e in event.events], axis=0)
    acc = RDPAccountant(relation, orders=orders)  # refuses what it cannot bound, naming it
    acc.compose(event)
    return np.asarray(acc.rdp, dtype=float)


def events_rdp(
    events: Sequence[PrivacyEvent],
    orders: Sequence[float] = DEFAULT_ORDERS,
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> np.ndarray:
    """The composed RDP curve of ``events``, including the events only an RDP analysis bounds.

    Besides everything :class:`~veil.accounting.rdp.RDPAccountant` composes: a
    :class:`~veil.accounting.events.RepeatAndSelect` gets the random-stopping bound above over its
    inner event's curve (the same bound as dp-accounting's ``RepeatAndSelectDpEvent``); a
    :class:`~veil.accounting.events.OneOf` the pointwise largest curve of its events (a
    data-independent choice); a :class:`~veil.accounting.events.ZeroConcentrated` ``α·ρ``. Events
    compose by adding curves (RDP composition). The PLD accountant refuses all three. Used by the
    budget registry (:mod:`veil.registry.compose`) to compose a dataset's runs in RDP.
    """
    relation = Neighbouring(neighbouring)
    total = np.zeros(len(orders))
    for event in events:
        if not event.supports_relation(relation):
            RDPAccountant(relation, orders=orders).compose(event)  # raises, naming the event
        total = total + _event_rdp(event, orders, relation)
    return total
