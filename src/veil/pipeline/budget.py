"""A job's budget plan: σ for the whole planned run, and how many steps fit, both from
:mod:`veil.accounting.calibrate` (the only place budget arithmetic is done).

Guarantee: the σ returned keeps ``prefix`` (events charged before training, e.g. a DP
preprocessing release) plus the planned steps within the target ε at δ (calibrate's guarantee);
:func:`allowed_steps` never allows a step that would take the run past the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from veil.accounting.calibrate import calibrate_noise, dpsgd_event, epsilon_of, max_steps
from veil.accounting.events import PrivacyEvent
from veil.config import TrainConfig
from veil.errors import UnreachableTargetError

__all__ = ["StepPlan", "allowed_steps", "noise_multiplier", "plan_steps"]


def noise_multiplier(cfg: TrainConfig, q: float, steps: int, prefix: Sequence[PrivacyEvent]) -> float:
    """σ: the configured one, or the smallest that fits ``prefix`` + ``steps`` steps at rate ``q``."""
    if cfg.noise_multiplier is not None:
        return float(cfg.noise_multiplier)
    if prefix and epsilon_of(prefix, cfg.delta, cfg.accountant) >= cfg.epsilon:
        raise UnreachableTargetError(
            "preprocessing_budget",
            cfg.preprocessing_budget,
            "the releases before training (a DP preprocessing statistic, the scattering preset's "
            "Gram release) already spend the whole target ε, leaving nothing for training",
            "raise --epsilon (the scattering preset's whitening needs more than its Gram release's "
            "cost), or lower preprocessing_budget or declare public feature_bounds",
        )
    return float(calibrate_noise(cfg.epsilon, cfg.delta, q, steps, cfg.accountant, prefix=prefix))


def allowed_steps(
    cfg: TrainConfig, sigma: float, q: float, want: int, prefix: Sequence[PrivacyEvent] = ()
) -> int:
    """The most further steps (≤ ``want``) at (σ, q) whose ε, after ``prefix``, stays within the target."""
    if want <= 0:
        return 0
    return max_steps(sigma, q, cfg.epsilon, cfg.delta, cfg.accountant, limit=want, prefix=prefix)


@dataclass(frozen=True)
class StepPlan:
    """The DP-SGD steps a job plans: Poisson rate q = B/N, the planned count and σ (0: non-private)."""

    q: float
    steps_per_epoch: int
    steps_planned: int
    sigma: float

    @property
    def step_event(self) -> PrivacyEvent:
        """The event of one step (:func:`~veil.accounting.calibrate.dpsgd_event`: the one definition)."""
        return dpsgd_event(self.q, self.sigma)


def plan_steps(
    cfg: TrainConfig, n_records: int, prefix: Sequence[PrivacyEvent], *, private: bool = True
) -> StepPlan:
    """``cfg.epochs`` epochs of Poisson-sampled steps over ``n_records`` records, σ fitted to the
    target after ``prefix`` (or given; 0 for a non-private reference run)."""
    from veil.sampling import steps_per_epoch

    assert cfg.batch_size is not None and cfg.epochs is not None
    q = cfg.batch_size / n_records
    spe = steps_per_epoch(n_records, cfg.batch_size)
    planned = cfg.epochs * spe
    sigma = noise_multiplier(cfg, q, planned, prefix) if private else 0.0
    return StepPlan(q, spe, planned, sigma)
