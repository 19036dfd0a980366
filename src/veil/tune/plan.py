"""How many trials ``veil tune`` runs and how loud its score is, chosen from public settings only.

The random-stopping bound makes every trial pay for the selection: at the same total ε a trial gets
more noise (σ) than one ``veil train`` run. A larger mean number of trials finds better settings more
often and costs more σ; a louder validation score costs less ε and selects worse. :func:`choose_plan`
takes the largest mean of :data:`MEANS` (truncated negative binomial with η = 0, the logarithmic law:
for a given mean the cheapest of the family in veil's grid) whose trial σ stays within
:data:`MAX_NOISE_RATIO` times the σ of ``veil train`` with the preset on the whole training split,
with the quietest score of :data:`SCORE_SHARES` that allows it. When no mean fits, the cheapest plan
(the smallest mean, the loudest score) is used and the report says that tuning is expensive here.

Privacy. The choice reads only public settings: the target ε and δ, the space's shapes, the preset,
the sampling rates (N, public under DP-SGD's convention, as for every plan) and the validation size
(a fixed share of N). No private result (no score, no trial) enters it, so the bound of
:mod:`veil.accounting.tuning` applies to the chosen law as to one given by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from veil.accounting.events import PrivacyEvent
from veil.accounting.tuning import TrialCount
from veil.errors import UnreachableTargetError
from veil.tune.budget import split_budget
from veil.tune.trial import score_event

__all__ = ["MAX_NOISE_RATIO", "MEANS", "SCORE_SHARES", "TrialPlan", "advice", "choose_plan"]

MEANS: tuple[float, ...] = (6.0, 4.0, 3.0, 2.0, 1.5)
# Score noise std as a share of the rows scored, quietest first. The shares under 3% matter on large
# data only: on Fashion-MNIST's 60,000 rows a count std of 120 (0.2%, 0.2 accuracy points) costs the
# trials no measurable σ, where 3% (1,800, 3 points) ordered candidates 1-2 points apart by chance.
# With the benchmarks' presets on small data (digits' rff, German credit, GBSG2) they cost too much σ
# and the plan is the 3%-or-louder one as before; on other shapes a quieter share is taken wherever
# the trial σ still fits MAX_NOISE_RATIO (e.g. 1,437 rows, 30 epochs of 256 at ε 3: a 1% score at a
# trial σ 0.9% above the 3% plan's) (docs/benchmarks.md, issue 29).
SCORE_SHARES: tuple[float, ...] = (0.002, 0.005, 0.01, 0.03, 0.06, 0.12)
MAX_NOISE_RATIO = 1.5
MIN_SCORE_NOISE = 2.0


@dataclass(frozen=True)
class TrialPlan:
    """The trial-count law and score noise, and what they cost against one ``veil train`` run."""

    count: TrialCount
    score_noise: float
    reference_sigma: float
    trial_sigma: float
    chosen_by: str  # "auto", "given" or "partly auto"
    n_validation: float  # the expected validation size (a share of the public N)

    @property
    def score_points(self) -> float:
        """The score noise's std in accuracy points (on the expected validation size)."""
        return 100 * self.score_noise / max(self.n_validation, 1.0)

    @property
    def resolution_points(self) -> float:
        """Public: the std, in accuracy points, of the difference between two candidates' noisy scores
        when their true accuracies are equal, bounding the binomial sampling of the scored rows by its
        worst case (accuracy 1/2) and adding the Gaussian noise: below it, the order is chance."""
        n = max(self.n_validation, 1.0)
        return 100 * (2 * ((self.score_noise / n) ** 2 + 0.25 / n)) ** 0.5

    @property
    def noise_ratio(self) -> float:
        return self.trial_sigma / self.reference_sigma

    @property
    def expensive(self) -> bool:
        return self.noise_ratio > MAX_NOISE_RATIO

    def to_dict(self) -> dict[str, object]:
        return {
            "chosen_by": self.chosen_by,
            "trials_mean": self.count.mean,
            "trials_law": self.count.law,
            "trials_shape": self.count.shape,
            "score_noise_std": self.score_noise,
            "score_noise_accuracy_points": self.score_points,
            "selection_resolution_points": self.resolution_points,
            "reference_noise_multiplier": self.reference_sigma,
            "trial_noise_multiplier": self.trial_sigma,  # the preset's shape (else the space's last)
            "noise_ratio": self.noise_ratio,
            "max_noise_ratio": MAX_NOISE_RATIO,
            "advice": advice(self),
        }


def advice(plan: TrialPlan) -> str:
    """One public sentence on the price of tuning (computed from the plan, never from a result)."""
    price = (
        f"each trial trains with σ = {plan.trial_sigma:.3g} where `veil train` with the preset would use "
        f"σ = {plan.reference_sigma:.3g} ({plan.noise_ratio:.2f}×) on 100% of the training split"
    )
    score = (
        f"the noisy score has a std of {plan.score_points:.1f} accuracy points on about "
        f"{plan.n_validation:.0f} rows, so with the rows' own sampling two candidates closer than about "
        f"{plan.resolution_points:.1f} points are ordered by chance"
    )
    if plan.expensive:
        return (
            f"Tuning is expensive here: {price}; above {MAX_NOISE_RATIO:g}× the search rarely pays, "
            f"prefer `veil train` unless the preset is known to fit this data badly; {score}."
        )
    return f"Tuning costs {price}; {score}."


def choose_plan(
    epsilon: float,
    delta: float,
    preset_shape: tuple[int, int, float, int],
    prefix: Sequence[PrivacyEvent],
    n_validation: int,
    ref_sigma: float,
) -> TrialPlan:
    """The automatic plan (module docstring) for the preset's shape (epochs, batch, q, steps)."""
    fallback: TrialPlan | None = None
    for mean in MEANS:
        for share in SCORE_SHARES:
            noise = max(MIN_SCORE_NOISE, share * n_validation)
            count = TrialCount(mean, "negative_binomial", 0.0)
            try:
                split = split_budget(epsilon, delta, count, [preset_shape], prefix, score_event(noise))
            except UnreachableTargetError:
                continue
            plan = TrialPlan(count, noise, ref_sigma, split.shapes[0].sigma, "auto", n_validation)
            if not plan.expensive:
                return plan
            if fallback is None or plan.trial_sigma < fallback.trial_sigma:
                fallback = plan
    if fallback is None:
        raise UnreachableTargetError(
            "epsilon",
            epsilon,
            "the validation scores (and preprocessing) alone spend the whole tuning budget at every "
            "plan of the automatic menu",
            "raise --epsilon, or run `veil train`",
        )
    return fallback
