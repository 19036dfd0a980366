"""The train job's run after preparation: start the pipeline's accounted loop, train to the step the
budget allows, evaluate, train the non-private baseline, and write the report and the outputs.

Guarantee (the job's, stated in :mod:`veil.training`): each step's event is in the ledger before its
update is used (:func:`veil.pipeline.loop.train_steps`); the last step allowed is computed here from
the ledger's events against the target (:func:`step_limit`), so a resumed run counts every step
ever charged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from veil.accounting.calibrate import epsilon_curve, epsilon_of
from veil.accounting.ledger import Ledger
from veil.config import TrainConfig
from veil.errors import BudgetExhaustedError
from veil.pipeline.baseline import BaselineResult, train_baseline
from veil.pipeline.budget import allowed_steps
from veil.pipeline.checks import train_checks
from veil.pipeline.loop import (
    AttachAudit,
    RunPlan,
    evaluate_released,
    install_whitening,
    start,
    train_steps,
)
from veil.report import Report
from veil.training.outputs import write_outputs
from veil.training.report import build_report

__all__ = ["clipping_section", "execute_run", "planned_curve", "step_limit"]


def step_limit(plan: RunPlan, ledger: Ledger) -> tuple[int, str | None]:
    """The last step number the budget allows (ledger included), and why it is short of the plan."""
    cfg, steps = plan.cfg, plan.steps
    limit = ledger.steps + allowed_steps(
        cfg, steps.sigma, steps.q, steps.steps_planned - ledger.steps, ledger.events()
    )
    if limit >= steps.steps_planned:
        return limit, None
    return limit, f"the budget allows {limit} of the {steps.steps_planned} planned steps " + (
        "at the given noise multiplier"
        if cfg.noise_multiplier is not None
        else "after the charges of interrupted runs"
    )


def planned_curve(plan: RunPlan, ledger: Ledger | None) -> list[tuple[int, float]]:
    """ε against the step for the planned run, after the released (or, before the run, planned)
    preprocessing; computed for a new run before its folder is created."""
    cfg, steps = plan.cfg, plan.steps
    if ledger is None:
        base_events = plan.prepared.pre_events
    else:
        base_events = [
            e for r, e in zip(_event_records(ledger), ledger.events(), strict=True) if r["kind"] == "event"
        ]
    return epsilon_curve(steps.step_event, steps.steps_planned, cfg.delta, cfg.accountant, prefix=base_events)


def execute_run(
    plan: RunPlan,
    run_dir: Path,
    ledger: Ledger,
    t0: float,
    progress: bool | None,
    curve: list[tuple[int, float]] | None = None,
    release: bool = True,
) -> Report:
    """Train ``plan`` to its step limit and write the run folder (:func:`write_outputs`).

    ``release=False``: no ``release/`` folder (the run is not published on its own: a tuning trial,
    covered only through the tuning bound, or the tune's preset reference, charged nowhere)."""
    from veil.progress import TrainingProgress, progress_enabled

    cfg = plan.cfg
    assert cfg.epochs is not None
    s = start(plan, run_dir, ledger, _audit_hook(cfg))
    limit, stop_reason = step_limit(plan, ledger)
    curve = curve if curve is not None else planned_curve(plan, ledger)
    enabled = progress_enabled(progress if progress is not None else cfg.progress)
    with TrainingProgress(enabled, limit, cfg.epochs) as bar:
        train_steps(s, plan, run_dir, ledger, limit, curve, bar)

    eps = epsilon_of(ledger.events(), cfg.delta, cfg.accountant)
    engine_eps = float(s.engine.get_epsilon(cfg.delta))
    if eps > cfg.epsilon:  # pragma: no cover - every step was checked to fit
        raise BudgetExhaustedError(
            "epsilon_spent", eps, "the ledger's ε passed the target", "report this as a bug"
        )
    audit = None if s.one_run is None else s.one_run.finish(delta=cfg.delta, epsilon_theoretical=eps)
    _, test_acc = evaluate_released(s, plan)
    install_whitening(plan, s.full)  # the released model maps raw images as the rows were trained on
    if ledger.last("end") is None or ledger.last("end")["charged"] != ledger.steps:  # type: ignore[index]
        ledger.append("end", charged=ledger.steps, applied=s.applied, epsilon=eps)
    baseline: BaselineResult | None = None
    if cfg.baseline and not cfg.stream:  # streamed: the baseline would need the table in memory
        baseline = train_baseline(plan, cfg.device)
    report = build_report(
        plan,
        run_dir,
        ledger,
        s.full,
        eps=eps,
        test_acc=test_acc,
        baseline_acc=None if baseline is None else baseline.test_accuracy,
        baseline_stopped=None if baseline is None else baseline.stopped,
        history={"dp": s.history, "baseline": [] if baseline is None else baseline.history},
        checks=train_checks(
            plan.prepared, plan.steps, eps, engine_eps, s.engine, ledger, s.clip_check, (s.drawn, s.taken)
        ),
        stop_reason=stop_reason,
        duration=time.monotonic() - t0,
        audit=audit,
        clipping=clipping_section(cfg, s.optimizer),
        dropped_not_finite=s.optimizer.clipper.dropped_not_finite,
    )
    write_outputs(report, run_dir, s.full, curve, plan.data.encoder, ledger, release)
    return report


def clipping_section(cfg: TrainConfig, optimizer: Any) -> dict[str, Any]:
    """The report's ``clipping`` section: the clip mode (an adaptive C's start and end) and K."""
    out: dict[str, Any] = {"mode": cfg.clip, "max_grad_norm": cfg.max_grad_norm, "augment": cfg.augment}
    hook = optimizer.adaptive
    if hook is not None:
        out.update(
            target_quantile=hook.state.target_quantile,
            final_clip=hook.state.clip,
            count_noise_std=hook.state.count_std,
            gradient_noise_multiplier=optimizer.noise_multiplier,
        )
    if cfg.augment > 1:
        out["augment_flip"] = cfg.augment_flip
    return out


def _event_records(ledger: Ledger) -> list[dict[str, Any]]:
    return [r for r in ledger.records if "event" in r]


def _audit_hook(cfg: TrainConfig) -> AttachAudit | None:
    """``--audit``: the audit package's hook, which the loop calls right after ``make_private``."""
    if not cfg.audit:
        return None
    from veil.audit.hook import train_audit

    return train_audit
