"""The accounting hook: every released logical step is composed into the accountant, before its update.

:class:`StepAccount` is the ``on_release`` callback the engine gives its
:class:`~veil.optimizer.DPOptimizer`: the optimizer calls it once per logical step, after the noisy
sum is formed and before the user's optimizer applies it, so the accountant (and through it the
ledger and the reported ε) never lags behind a released update. Each call is for a logical batch
drawn for that release alone: the optimizer refuses, before calling it, a step with no new batch from
the private loader (two releases on one sample are not two independent sampled events;
:mod:`veil.optimizer`). The event is the plan's
(:attr:`veil.plan.PrivacyPlan.event`): ``PoissonSampled(q, Gaussian(σ))``, ``Gaussian(σ/2)`` for the
shuffled loader, ``NonPrivate`` at σ = 0.
"""

from __future__ import annotations

from veil.accounting.base import PrivacyAccountant
from veil.plan import PrivacyPlan

__all__ = ["StepAccount"]


class StepAccount:
    """The run's accountant and the number of logical steps composed into it."""

    def __init__(self, accountant: PrivacyAccountant) -> None:
        self.accountant = accountant
        self.steps = 0
        self.plan: PrivacyPlan | None = None

    def __call__(self) -> None:
        """One logical step released: compose the plan's event (``DPOptimizer``'s ``on_release``)."""
        assert self.plan is not None
        self.accountant.compose(self.plan.event)
        self.steps += 1

    def restore(self, accountant: PrivacyAccountant, steps: int) -> None:
        """Continue from a checkpoint's rebuilt accountant and step count."""
        self.accountant, self.steps = accountant, steps
