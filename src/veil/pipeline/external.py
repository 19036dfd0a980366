"""The pipeline for a training loop veil does not own (the Hugging Face ``Trainer``, Lightning, a
library user's own loop around :class:`veil.PrivacyEngine`, which alone never charges the registry).

A framework adapter (:mod:`veil.hf.trainer`, :mod:`veil.lightning`; or a user's loop, as in
``docs/budget.md``, "Your own training loop") keeps its framework's loop and
hands veil the three things DP-SGD needs from it — the dataset size N, the expected batch size B and
the planned number of optimizer steps — then asks :class:`ExternalRun` for everything private, in the
same order as ``veil train``:

1. :meth:`ExternalRun.begin` — before a row is read: the settings checked, the dataset's registry
   account opened (a spent dataset is refused), σ calibrated for the planned steps
   (:func:`veil.accounting.calibrate.calibrate_noise`, on the private side of the target) or the
   given σ checked to fit, the run folder checked, and the whole plan reserved in the registry.
2. :meth:`ExternalRun.make_private` — :meth:`veil.PrivacyEngine.make_private` with that σ:
   Poisson sampling, exact per-sample clipping, secure noise, one event composed per step.
3. :meth:`ExternalRun.finish` — the registry settled with the events the engine composed (what was
   released) and ``report.json``/``report.html`` written atomically into the run folder.

Guarantee (add/remove-one neighbouring on the training set's examples, N treated as public): the
weights the framework ends with are (ε, δ)-DP with ε the accountant's for every step taken, which
never exceeds the target because the framework cannot step past the planned count (the adapter
checks that the framework's plan is the one calibrated). Assumptions the adapter must keep: every
optimizer step is the engine's DP step (no other gradient reaches the weights) and the loss is a
fixed-coefficient sum of per-example terms (see :mod:`veil.per_example_loss`). The number of steps is
public only when the loop runs to its plan: a user's callback may stop it on a score computed without
noise (the adapters refuse the frameworks' own early-stopping switches, but cannot read arbitrary
code), so a run that stops before its planned steps is reported not release-ready (check
``planned_steps_taken``) and its whole plan stays charged in the registry.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from veil.accounting.calibrate import calibrate_noise, dpsgd_event, epsilon_of
from veil.accounting.events import PrivacyEvent, SelfComposed
from veil.errors import BudgetExhaustedError, ConfigError, InvalidParameterError, UnreachableTargetError
from veil.pipeline.run_folder import check_out, write_files

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader

    from veil.engine import PrivacyEngine, PrivateTraining
    from veil.registry.charge import DatasetCharge

__all__ = ["ExternalRun", "PrivacyTarget", "noiseless_score_refused", "planned_steps", "resume_refused"]


@dataclass(frozen=True)
class PrivacyTarget:
    """The privacy settings a framework adapter takes: target (ε, δ), clip norm C, optional σ.

    ``noise_multiplier=None`` calibrates σ to the target over the planned steps; a given σ must let
    the planned steps fit the target. ``dataset_id`` names the dataset's budget in the registry
    (required: the budget is kept per dataset). Checked when built.
    """

    target_epsilon: float
    target_delta: float
    max_grad_norm: float
    noise_multiplier: float | None = None
    dataset_id: str | None = None
    accountant: Literal["pld", "rdp"] = "pld"

    def __post_init__(self) -> None:
        positive = {
            "target_epsilon": (self.target_epsilon, "pass the ε the run may spend, e.g. 3.0"),
            "target_delta": (self.target_delta, "pass δ well below 1/N, e.g. 1e-5"),
            "max_grad_norm": (self.max_grad_norm, "pass the per-example clip norm C, e.g. 1.0"),
        }
        for name, (value, fix) in positive.items():
            if not _finite_positive(value):
                raise InvalidParameterError(name, value, "it must be a finite number > 0", fix)
        if self.target_delta >= 1:
            raise InvalidParameterError(
                "target_delta", self.target_delta, "δ is a probability of failure, far below 1", "e.g. 1e-5"
            )
        sigma = self.noise_multiplier
        if sigma is not None and not _finite_positive(sigma):
            raise InvalidParameterError(
                "noise_multiplier",
                sigma,
                "σ must be a finite number > 0 (σ = 0 is no privacy, which a target ε cannot bound)",
                "pass σ > 0, or leave it None to calibrate it to the target",
            )
        if self.accountant not in ("pld", "rdp"):
            raise InvalidParameterError("accountant", self.accountant, "unknown accountant", "use pld or rdp")
        if self.dataset_id is None:
            raise InvalidParameterError(
                "dataset_id",
                None,
                "the privacy budget is kept per dataset in the registry, and an in-memory dataset has no "
                "file to identify it by",
                "name the dataset's budget, e.g. dataset_id='support-tickets-2026'",
            )


def _finite_positive(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def planned_steps(n: int, batch_size: int, epochs: float, max_steps: int | None) -> tuple[int, int]:
    """``(steps per epoch, planned steps)``: ⌈N/B⌉ logical steps an epoch; ``max_steps`` when given
    (> 0), else ⌈epochs × ⌈N/B⌉⌉ — how Hugging Face and Lightning both count a run's steps."""
    from veil.sampling import steps_per_epoch

    per_epoch = steps_per_epoch(n, batch_size)
    if max_steps is not None and max_steps > 0:
        return per_epoch, int(max_steps)
    return per_epoch, max(1, math.ceil(epochs * per_epoch))


def resume_refused(name: str, value: Any, fix: str) -> ConfigError:
    """The refusal of a fit resumed from a checkpoint, the same reason for every adapter (raised before
    :meth:`ExternalRun.begin`): the framework would continue weights that already went through noisy
    steps while a new run's accountant starts at zero, so the report would under-count ε."""
    return ConfigError(
        name,
        value,
        "a resumed fit would restart veil's accountant: the weights went through the earlier steps too, "
        "and the report would state only the ε of the steps after the resume",
        fix,
    )


def noiseless_score_refused(name: str, value: Any, use: str, fix: str) -> ConfigError:
    """The refusal of a switch that feeds a score computed without noise (an evaluation metric, or a
    metric of the training rows) back into the run: ``use`` says what it steers ("choosing the
    released weights", "stopping training", "setting the learning rate"). The choice would depend on
    rows through a channel DP-SGD's noise does not cover, and it is reflected in what is released
    (the weights, the steps the report accounts, the logged learning rate)."""
    return ConfigError(
        name,
        value,
        f"{use} by a score computed without noise is a data-dependent choice that DP-SGD's accounting "
        "does not cover (the rows it is computed on, evaluation or training, are treated as private)",
        fix,
    )


class ExternalRun:
    """One DP training run inside another framework's loop (see the module doc for the order)."""

    def __init__(self, target: PrivacyTarget, *, job: str, out: str | Path, primary: bool = True) -> None:
        self.target = target
        self.primary = primary  # across ranks: rank 0 alone charges the registry and writes the report
        self.job = job
        self.out = Path(out)
        self.engine: PrivacyEngine | None = None
        self.charge: DatasetCharge | None = None
        self.n = 0
        self.batch_size = 0
        self.steps_planned = 0
        self.sigma = 0.0
        self.run_id = ""
        self.curve: list[tuple[int, float]] = []
        self._t0 = time.monotonic()

    # -- 1. before a row is read -----------------------------------------------------------------
    def begin(self, n: int, batch_size: int, steps: int) -> float:
        """Plan (σ for ``steps`` Poisson steps at q = B/N), check the folder, reserve; returns σ.

        Nothing is reserved if any check fails; the registry account is closed again then."""
        from veil.registry.charge import DatasetCharge
        from veil.sampling import check_sampling_rate

        t = self.target
        if t.target_delta >= 1.0 / n:
            raise InvalidParameterError(
                "target_delta",
                t.target_delta,
                f"δ ≥ 1/N (N = {n}) allows a mechanism that publishes one whole record outright",
                f"pass δ well below 1/N, e.g. {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
            )
        q = check_sampling_rate(batch_size, n)
        self.n, self.batch_size, self.steps_planned = n, batch_size, steps
        if not self.primary:  # σ is the same computation on every rank (the engine checks they agree)
            self.sigma = self._sigma(q, steps)
            return self.sigma
        check_out(self.out)
        charge = DatasetCharge.before_reading("", job=self.job, dataset_id=t.dataset_id)
        try:
            sigma = self._sigma(q, steps)
            run_id = uuid.uuid4().hex
            charge.reserve([SelfComposed(dpsgd_event(q, sigma), steps)], run_id, t.target_delta)
        except BaseException:
            charge.close()
            raise
        self.charge, self.run_id, self.sigma = charge, run_id, sigma
        return sigma

    def _sigma(self, q: float, steps: int) -> float:
        t = self.target
        if t.noise_multiplier is None:
            return float(calibrate_noise(t.target_epsilon, t.target_delta, q, steps, t.accountant))
        planned = [SelfComposed(dpsgd_event(q, t.noise_multiplier), steps)]
        eps = epsilon_of(planned, t.target_delta, t.accountant)
        if eps > t.target_epsilon:
            raise UnreachableTargetError(
                "noise_multiplier",
                t.noise_multiplier,
                f"the {steps} planned steps at q = {q:.4g} spend ε = {eps:.4g}, above the target "
                f"{t.target_epsilon:g}",
                "raise noise_multiplier, plan fewer steps, or leave noise_multiplier=None to calibrate it",
            )
        return float(t.noise_multiplier)

    # -- 2. the engine -----------------------------------------------------------------------------
    def make_private(
        self, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader, **kwargs: Any
    ) -> PrivateTraining:
        """``PrivacyEngine(accountant).make_private`` with the planned σ and C (secure randomness).

        ``data_loader.batch_size`` must be the B given to :meth:`begin`."""
        from veil.engine import PrivacyEngine

        if data_loader.batch_size != self.batch_size:
            raise InvalidParameterError(
                "batch_size",
                data_loader.batch_size,
                f"σ was calibrated for the expected batch size {self.batch_size}",
                "pass the loader whose batch size was planned",
            )
        engine = PrivacyEngine(accountant=self.target.accountant)
        private = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=self.sigma,
            max_grad_norm=self.target.max_grad_norm,
            **kwargs,
        )
        self.engine = engine
        return private

    # -- during the run ----------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Noisy steps taken (each composed into the accountant before its update was written)."""
        return 0 if self.engine is None else self.engine.steps

    @property
    def epsilon(self) -> float:
        """ε spent so far at the target δ (0 before the first step)."""
        if self.engine is None or self.engine.steps == 0:
            return 0.0
        return float(self.engine.get_epsilon(self.target.target_delta))

    def record_epsilon(self) -> float:
        """ε now, also kept for the report's curve (one point per step count)."""
        eps = self.epsilon
        if not self.curve or self.curve[-1][0] != self.steps:
            self.curve.append((self.steps, eps))
        return eps

    def check_step_fits(self) -> None:
        """Refuse a step beyond the planned count (its ε was never calibrated nor reserved). A function
        of the step count alone; a framework whose step count matches the plan never triggers it."""
        if self.steps >= self.steps_planned:
            raise BudgetExhaustedError(
                "steps",
                self.steps + 1,
                f"σ was calibrated and the registry reserved for {self.steps_planned} steps; one more "
                "would spend more than the target ε",
                "let the framework stop at its planned steps (max_steps / epochs as given at the start)",
            )

    @property
    def completed(self) -> bool:
        """Whether the loop took every planned step (a function of the step count alone)."""
        return self.steps >= self.steps_planned

    def events(self) -> list[PrivacyEvent]:
        """The events released so far: one per noisy step."""
        return [] if self.engine is None else list(self.engine.accountant.ledger.events)

    # -- 3. the end --------------------------------------------------------------------------------
    def finish(
        self, *, framework: str, non_private: dict[str, Any] | None = None, world_size: int = 1
    ) -> dict[str, Any] | None:
        """Settle the registry with what was released and write the report; returns it (None when the
        run never began or never reached the engine, and on a rank other than 0). Safe to call twice:
        the second call does nothing."""
        charge, self.charge = self.charge, None
        if charge is None:
            return None
        events = self.events()
        # A loop that stopped before its plan (a callback's stop, an exception, an interrupt) may have
        # stopped on a value computed from the data without noise: the plan stays charged, so the
        # registry's record never depends on when it stopped; the report says not release-ready.
        charge.finish(events if events and self.completed else None)
        if self.engine is None:  # refused before the engine was built: nothing trained, no report
            return None
        self.record_epsilon()
        report = self._report(framework, non_private or {}, world_size)
        from veil.report.framework import render_framework_html

        write_files(
            self.out,
            {"report.html": render_framework_html(report), "report.json": _json(report)},
        )
        return report

    def _report(self, framework: str, non_private: dict[str, Any], world_size: int) -> dict[str, Any]:
        import veil
        from veil.pipeline.randomness import randomness_check

        t = self.target
        randomness = "secure" if self.engine is None else self.engine.randomness
        eps = self.epsilon
        checks = [
            randomness_check(randomness).model_dump(),
            {
                "name": "within_target",
                "passed": eps <= t.target_epsilon,
                "detail": f"ε spent {eps:.4g} ≤ target {t.target_epsilon:g} after {self.steps} steps",
            },
            {
                "name": "planned_steps_taken",
                "passed": self.completed,
                "detail": (
                    f"the loop took its {self.steps_planned} planned steps"
                    if self.completed
                    else f"the loop stopped after {self.steps} of {self.steps_planned} planned steps: a "
                    "callback's stop, an exception or an interrupt, which may have depended on a value "
                    "computed from the data without noise (an evaluation score); the whole plan stays "
                    "charged. To release, run to the planned steps (max_steps / epochs)"
                ),
            },
        ]
        q = self.batch_size / self.n
        return {
            "job": self.job,
            "framework": framework,
            "epsilon_spent": eps,
            "target_epsilon": t.target_epsilon,
            "delta": t.target_delta,
            "accountant": t.accountant,
            "neighbouring": "add_or_remove_one",
            "privacy_unit": "one training example",
            "noise_multiplier": self.sigma,
            "max_grad_norm": t.max_grad_norm,
            "sampling": "poisson",
            "sampling_rate": q,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "steps_planned": self.steps_planned,
            "epsilon_curve": [{"step": s, "epsilon": e} for s, e in self.curve],
            "dataset": {"id": t.dataset_id, "n_train": self.n},
            "budget_run_id": self.run_id,
            "randomness": randomness,
            "release_ready": all(c["passed"] for c in checks),
            "checks": checks,
            "covers": (
                f"the weights after the {self.steps} noisy DP-SGD steps taken by the {framework} loop, as a "
                f"function of the {self.n} training examples of dataset '{t.dataset_id}', under "
                "add/remove-one neighbouring (N is public). Not covered: the non_private section "
                "(training loss, evaluation metrics) and anything the loop logged from the data itself"
            ),
            "veil_version": veil.__version__,
            "duration_s": time.monotonic() - self._t0,
            "world_size": world_size,
            "non_private": {
                "note": "computed from the data without privacy, for the operator only: not covered",
                **non_private,
            },
            "files": {
                "report.json": "this report, machine-readable",
                "report.html": "this report as a page",
            },
            "out_dir": str(self.out),
        }


def _json(report: dict[str, Any]) -> str:
    import json

    return json.dumps(_finite(report), indent=2, allow_nan=False, default=str) + "\n"


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss) written as ``null``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
