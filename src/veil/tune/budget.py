"""How ``veil tune`` splits its budget: each trial shape's σ so that the *whole* procedure meets the target.

Guarantee. A trial is: the preprocessing release (if any), ``steps`` DP-SGD steps (Poisson rate q,
noise σ) and one Gaussian-noised validation count. Since the trial's hyperparameters are drawn at
random independently of the data and are part of its output, the trial's Rényi divergence at order λ
is at most the largest over the shapes (epochs, batch size) in the space; that pointwise maximum is
the curve fed to the random-stopping bound of :mod:`veil.accounting.tuning`. :func:`split_budget`
returns σ's for which that bound, converted at δ, is at most the target, checked at the end on the
exact curves it returns (the search can only cost tightness, never privacy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from veil.accounting.calibrate import dpsgd_event
from veil.accounting.events import Composed, OneOf, PrivacyEvent, RepeatAndSelect, SelfComposed
from veil.accounting.rdp import rdp_to_epsilon
from veil.accounting.tuning import TrialCount, repeat_and_select, trial_rdp, tuning_rdp
from veil.errors import UnreachableTargetError

__all__ = ["ORDERS", "BudgetSplit", "ShapePlan", "split_budget"]

# Integer orders (exact, fast RDP of the sampled Gaussian) and a few large ones.
ORDERS: tuple[float, ...] = (*(float(a) for a in range(2, 65)), 80.0, 96.0, 128.0, 192.0, 256.0)
SIGMA_MIN, SIGMA_MAX = 0.3, 500.0


@dataclass(frozen=True)
class ShapePlan:
    """One trial shape: its sampling rate, planned steps and the σ chosen for it."""

    epochs: int
    batch_size: int
    q: float
    steps: int
    sigma: float

    def events(self, prefix: Sequence[PrivacyEvent], score: PrivacyEvent) -> list[PrivacyEvent]:
        return [*prefix, SelfComposed(dpsgd_event(self.q, self.sigma), self.steps), score]


@dataclass(frozen=True)
class BudgetSplit:
    """The plan: σ per shape, the trial-count law, and the ε of each part at δ (one trial alone)."""

    shapes: tuple[ShapePlan, ...]
    count: TrialCount
    score_event: PrivacyEvent
    prefix: tuple[PrivacyEvent, ...]
    delta: float
    epsilon: float

    def shape(self, epochs: int, batch_size: int) -> ShapePlan:
        return next(s for s in self.shapes if (s.epochs, s.batch_size) == (epochs, batch_size))

    def trial_curve(self) -> np.ndarray:
        """The pointwise largest RDP curve over the shapes: one trial's bound."""
        return np.max(
            [trial_rdp(s.events(self.prefix, self.score_event), ORDERS) for s in self.shapes], axis=0
        )

    def event(self) -> RepeatAndSelect:
        """The whole procedure as one event (charged to the budget registry): K trials, each one of the
        shapes (drawn independently of the data), only the best released. Its RDP curve is the bound
        above (:func:`veil.accounting.tuning.events_rdp`)."""
        trials = [Composed(s.events(self.prefix, self.score_event)) for s in self.shapes]
        return repeat_and_select(trials[0] if len(trials) == 1 else OneOf(trials), self.count)

    def trial_epsilon(self, events: Sequence[PrivacyEvent]) -> float:
        """ε at δ of one set of events alone (for the report's split, never the total)."""
        return rdp_to_epsilon(ORDERS, trial_rdp(events, ORDERS), self.delta)


def _total(curves: Sequence[np.ndarray], count: TrialCount, delta: float) -> float:
    return float(rdp_to_epsilon(ORDERS, tuning_rdp(ORDERS, np.max(curves, axis=0), count), delta))


def _fixed_rdp(prefix: Sequence[PrivacyEvent], score: PrivacyEvent) -> np.ndarray:
    return trial_rdp([*prefix, score], ORDERS)


def split_budget(
    target: float,
    delta: float,
    count: TrialCount,
    shapes: Sequence[tuple[int, int, float, int]],
    prefix: Sequence[PrivacyEvent],
    score_event: PrivacyEvent,
) -> BudgetSplit:
    """σ for each shape (epochs, batch size, q, steps) so the tuning total is ≤ ``target`` at ``delta``.

    Each shape's σ makes *its own* tuning total equal a common level t; t is then lowered until the
    total over the shapes' pointwise maximum fits (usually at once: the shapes end up with nearly
    the same curve)."""
    fixed = _fixed_rdp(prefix, score_event)
    if _total([fixed], count, delta) >= target:
        raise UnreachableTargetError(
            "epsilon",
            target,
            "the validation scores (and preprocessing) alone spend the whole tuning budget",
            "raise --epsilon, raise --score-noise or lower --trials-mean",
        )

    def curve(q: float, steps: int, sigma: float) -> np.ndarray:
        return fixed + steps * trial_rdp([dpsgd_event(q, sigma)], ORDERS)

    def sigma_for(q: float, steps: int, level: float) -> float:
        lo, hi = math.log(SIGMA_MIN), math.log(SIGMA_MAX)
        if _total([curve(q, steps, SIGMA_MAX)], count, delta) > level:
            raise UnreachableTargetError(
                "epsilon", target, f"even σ = {SIGMA_MAX:g} does not fit the tuning budget", "raise --epsilon"
            )
        for _ in range(22):  # σ to within 0.2%
            mid = (lo + hi) / 2
            if _total([curve(q, steps, math.exp(mid))], count, delta) > level:
                lo = mid
            else:
                hi = mid
        return math.exp(hi)

    level, best = target, None
    for _ in range(6):
        sigmas = [sigma_for(q, steps, level) for (_, _, q, steps) in shapes]
        plans = tuple(
            ShapePlan(e, b, q, steps, s) for (e, b, q, steps), s in zip(shapes, sigmas, strict=True)
        )
        split = BudgetSplit(plans, count, score_event, tuple(prefix), delta, math.inf)
        # Each candidate answer checked on the events themselves.
        total = rdp_to_epsilon(ORDERS, tuning_rdp(ORDERS, split.trial_curve(), count), delta)
        if total <= target and (best is None or total > best.epsilon):
            best = BudgetSplit(plans, count, score_event, tuple(prefix), delta, total)
        if best is not None and best.epsilon >= 0.995 * target:
            break
        # A small Poisson mean can make the bound vanish at this level (log E[K] < 0): raise it.
        level *= (target / total) * (0.998 if total > target else 1.0) if total > 0 else 2.0
    if best is None:  # pragma: no cover - the level search converges in one or two rounds
        raise UnreachableTargetError(
            "epsilon", target, "no σ split fits the tuning budget", "report this as a bug"
        )
    return best
