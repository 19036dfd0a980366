"""``veil train`` as a function: :func:`train` runs one DP training job end to end, returns a :class:`Report`.

Flow: config → budget (a stand-in of the target ε at δ reserved before a row is read: a refusal after
reading stays charged) → data (load, check, split) → model (zoo or the user's factory) →
validate/fix → preprocessing plan → σ calibrated so that the whole planned run (preprocessing
included) fits the target (ε, δ) → the plan replaces the stand-in → run folder (lock,
``config.toml``, ledger) → DP preprocessing release → DP-SGD with Poisson sampling → evaluation →
non-private baseline → ``report.json``, ``report.html``, plots, ``model.pt``.

Guarantee. The released weights (``model.pt``) are (ε_spent, δ)-DP for the training split under
add/remove-one neighbouring, where ε_spent is the accountant's ε for *every* event in the run's
ledger and never exceeds the target: before each step, the step's event is checked to fit and is
written and fsync'ed to the ledger before its noisy update is computed; training stops before a step
that would not fit. A resumed run charges every step ever recorded, including steps whose updates a
crash lost. Everything is validated (config, data, model, calibration, output folder) before the run
folder is created, so bad input leaves nothing behind and existing outputs untouched.

Randomness. Noise and Poisson sampling come from the OS CSPRNG unless research mode is asked for
(``reproducible``; :mod:`veil.pipeline.randomness`); the report says which (``randomness``) and
whether the model may be released (``release_ready``: secure randomness and every check passed).

Not covered by the guarantee (the report's one ``non_private`` section): the test metrics (a
non-private release about the held-out rows), the non-private baseline (trained on the private
split; skip it with ``--no-baseline``), the one-run audit, and the dataset's sha256 fingerprint. N
is treated as public; the label set is public by declaration.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.accounting.calibrate import epsilon_curve, epsilon_of
from veil.accounting.events import PrivacyEvent, SelfComposed
from veil.accounting.ledger import Ledger, RunLock
from veil.config import TrainConfig, load_config_file, make_config, write_config
from veil.distributed.runtime import rank_and_world, refuse_private_preprocessing
from veil.errors import (
    BudgetExhaustedError,
    CheckpointError,
    ConfigError,
    DataError,
    InvalidParameterError,
    RunInterrupted,
)
from veil.pipeline import checkpoints as ckpt
from veil.pipeline.baseline import BaselineResult, train_baseline
from veil.pipeline.budget import allowed_steps, plan_steps
from veil.pipeline.checks import data_use_check, train_checks
from veil.pipeline.data import prepare
from veil.pipeline.loop import RunPlan, evaluate_released, start, train_steps
from veil.pipeline.model import assemble, build_net
from veil.pipeline.outputs import model_bytes
from veil.pipeline.private_data import stand_in_plan
from veil.pipeline.randomness import RESEARCH_CAVEAT, randomness_of, release_ready
from veil.pipeline.run_folder import CHECKPOINTS, CONFIG, LEDGER, check_out, default_out, write_files
from veil.pipeline.units import unit_covers, unit_section
from veil.registry.charge import DatasetCharge
from veil.report import DatasetInfo, NonPrivate, Report
from veil.report.train_report import file_table

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Report", "train"]


# ----------------------------------------------------------------------------------------------
# Preparation: everything checked before anything is written (then the run: veil.pipeline.loop)
# ----------------------------------------------------------------------------------------------
def _prepare(cfg: TrainConfig, out: Path | None, check: bool = True) -> RunPlan:
    from veil.engine import refuse_example_mixing
    from veil.precision import autocast

    autocast(cfg.device, cfg.precision)  # a precision the device lacks is refused before anything is written
    prepared = prepare(cfg, streaming=True, units=True)
    refuse_private_preprocessing(prepared.prep.public)  # across ranks: one release is not yet supported
    cfg, data = prepared.cfg, prepared.data
    net = build_net(cfg, data, cfg.seed)
    if cfg.stream:
        from veil.pipeline.streaming import refuse_fixed_front

        refuse_fixed_front(assemble(prepared.prep, data.input_shape, net))
    refuse_unsupported_augment(cfg, data, net)
    steps = plan_steps(cfg, data.n_records, prepared.pre_events)  # units, with a privacy unit
    allowed = allowed_steps(cfg, steps.sigma, steps.q, steps.steps_planned, prepared.pre_events)
    if cfg.clip == "adaptive":  # the count's noise must fit inside the step's σ: refused before writing
        from veil.clipping.adaptive import gradient_noise

        gradient_noise(steps.sigma, steps.q * data.n_records / 20)  # B/20, the hook's default
    if allowed == 0:
        raise BudgetExhaustedError(
            "noise_multiplier",
            steps.sigma,
            f"not even one training step fits the target ε = {cfg.epsilon:g}",
            "raise --noise-multiplier or --epsilon, or omit --noise-multiplier to calibrate it",
        )
    out_dir = Path(out if out is not None else (cfg.out or default_out(cfg.dataset)))
    if check:
        check_out(out_dir)
    prepared.cfg = cfg.model_copy(update={"out": str(out_dir)})
    # Before anything is written: the whole model (a fixed feature front included, which the
    # engine never sees) must compute each example's output from that example alone.
    refuse_example_mixing(assemble(prepared.prep, data.input_shape, net), data.x_train, data.y_train)
    return RunPlan(prepared, net, steps, allowed, out_dir)


def refuse_unsupported_augment(cfg: TrainConfig, data: Any, net: nn.Module) -> None:
    """``--augment K > 1`` only for images and end-to-end models (see veil.augment.multiplicity)."""
    from veil.augment.multiplicity import refuse_unsupported
    from veil.models import FixedFeaturesThenHead, resolve_name

    fixed = isinstance(net, FixedFeaturesThenHead)
    name = resolve_name(cfg.model, data.kind, data.input_shape)
    refuse_unsupported(cfg.augment, data.kind, data.input_shape, name, fixed)


def _header(plan: RunPlan) -> dict[str, Any]:
    import veil

    cfg, steps = plan.cfg, plan.steps
    return {
        "veil_version": veil.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "accountant": cfg.accountant,
        "neighbouring": "add_or_remove_one",
        "target_epsilon": cfg.epsilon,
        "delta": cfg.delta,
        "noise_multiplier": steps.sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "sampling": "poisson",
        "sampling_rate": steps.q,
        "batch_size": cfg.batch_size,
        "steps_planned": steps.steps_planned,
        "dataset_sha256": plan.data.sha256,
        "n_train": plan.data.n_train,
        "privacy_unit": plan.cfg.privacy_unit,
        "max_rows_per_unit": _max_rows(plan) if plan.cfg.privacy_unit else None,
        "preprocessing": plan.prep.method,
        "preprocessing_event": None if plan.prep.event is None else plan.prep.event.to_dict(),
        "step_event": steps.step_event.to_dict(),
        "secure_rng": cfg.secure_rng,
    }


def _step_limit(plan: RunPlan, ledger: Ledger) -> tuple[int, str | None]:
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


def _curve(plan: RunPlan, ledger: Ledger | None) -> list[tuple[int, float]]:
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


def _execute(
    plan: RunPlan,
    run_dir: Path,
    ledger: Ledger,
    t0: float,
    progress: bool | None,
    curve: list[tuple[int, float]] | None = None,
) -> Report:
    from veil.progress import TrainingProgress, progress_enabled

    cfg = plan.cfg
    assert cfg.epochs is not None
    s = start(plan, run_dir, ledger)
    limit, stop_reason = _step_limit(plan, ledger)
    curve = curve if curve is not None else _curve(plan, ledger)
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
    if ledger.last("end") is None or ledger.last("end")["charged"] != ledger.steps:  # type: ignore[index]
        ledger.append("end", charged=ledger.steps, applied=s.applied, epsilon=eps)
    baseline: BaselineResult | None = None
    if cfg.baseline and not cfg.stream:  # streamed: the baseline would need the table in memory
        baseline = train_baseline(plan, cfg.device)
    report = _report(
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
        clipping=_clipping(cfg, s.optimizer),
    )
    _write_outputs(report, run_dir, s.full, curve, plan.data.encoder, ledger)
    return report


def _clipping(cfg: TrainConfig, optimizer: Any) -> dict[str, Any]:
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


_FILES = (
    "report.json",
    "report.html",
    "epsilon.png",
    "curves.png",
    "model.pt",
    "config.toml",
    LEDGER,
    CHECKPOINTS,
)


def _report(plan: RunPlan, run_dir: Path, ledger: Ledger, model: nn.Module, **result: Any) -> Report:
    """The :class:`Report` of a finished run (``result``: ε, accuracies, history, checks, ...)."""
    import veil

    cfg, data, steps = plan.cfg, plan.data, plan.steps
    assert cfg.max_grad_norm is not None and cfg.batch_size is not None
    assert cfg.epochs is not None and cfg.lr is not None
    names = [*_FILES, "release"]
    if not plan.prep.public:
        names.append("preprocessing.json")
    if data.encoder is not None:
        names.append("encoder.json")
    files = file_table(names)
    baseline_acc, test_acc = result["baseline_acc"], result["test_acc"]
    randomness = randomness_of(cfg.reproducible)
    units = unit_section(cfg, data, _max_rows(plan))
    report = Report(
        epsilon_spent=result["eps"],
        target_epsilon=cfg.epsilon,
        delta=cfg.delta,
        accountant=cfg.accountant,
        noise_multiplier=steps.sigma,
        max_grad_norm=cfg.max_grad_norm,
        sampling_rate=steps.q,
        batch_size=cfg.batch_size,
        steps=ledger.steps,
        steps_planned=steps.steps_planned,
        epochs=cfg.epochs,
        stopped_early=result["stop_reason"] is not None,
        stop_reason=result["stop_reason"],
        clipping=result.get("clipping"),
        preprocessing={
            "method": plan.prep.method,
            "description": plan.prep.description,
            "public": plan.prep.public,
            "event": None if plan.prep.event is None else plan.prep.event.to_dict(),
        },
        dataset=DatasetInfo(
            name=data.name,
            n_train=data.n_train,
            n_test=data.n_test,
            sha256=data.sha256,
            kind=data.kind,
            num_classes=data.num_classes,
        ),
        label_set={
            "source": "declared",
            "classes": list(data.classes),
            "declared_by": data.classes_declared_by,
        },
        model=plan.model_name,
        pretrained=getattr(plan.net, "veil_pretrained", None),
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        optimizer=cfg.optimizer or "sgd",
        lr=cfg.lr,
        randomness=randomness,
        release_ready=False,
        covers=_covers(plan, ledger),
        neighbouring="add_or_remove_one" if units is None else "add_or_remove_one_unit",
        privacy_unit=units,
        seed=cfg.seed,
        veil_version=veil.__version__,
        duration_s=result["duration"],
        resumes=sum(1 for _ in ledger.of_kind("resume")),
        world_size=rank_and_world()[1],
        checks=result["checks"],
        non_private=NonPrivate(
            test_accuracy=test_acc,
            baseline_test_accuracy=baseline_acc,
            baseline_stopped=result["baseline_stopped"],
            utility_drop=None if baseline_acc is None else baseline_acc - test_acc,
            history=result["history"],
            audit=result["audit"],
            per_record_rules=dict(plan.data.rules),
            labelled_elsewhere={
                "dataset.sha256": "a fingerprint of the whole private file: it confirms a guess of the "
                "entire dataset; kept for the audit trail and resume checks",
                "dataset.n_test": "the number of held-out rows",
                **(
                    {
                        "dataset.n_train": "the number of training rows: with a privacy unit only the "
                        "number of units is public by declaration; the row count depends on how many "
                        "rows each person has"
                    }
                    if units is not None
                    else {}
                ),
                **(
                    {
                        "streaming": "how the file was read: windows, row groups read, rows decoded and "
                        "the most rows held depend on the realised Poisson batches, and the evaluated "
                        "count on the held-out rows; for the operator, like the sampling check's counts"
                    }
                    if cfg.stream
                    else {}
                ),
            },
        ),
        files=files,
        out_dir=str(run_dir),
        streaming=data.summary() if cfg.stream else None,  # type: ignore[attr-defined]
    )
    checks = [*result["checks"], data_use_check(plan.prepared, ledger, report.to_dict())]
    return report.model_copy(update={"checks": checks, "release_ready": release_ready(randomness, checks)})


def _covers(plan: RunPlan, ledger: Ledger) -> str:
    """What the (ε, δ) guarantee covers, in words (the report's ``covers``)."""
    cfg = plan.cfg
    pre = "" if plan.prep.public else " and the DP preprocessing statistic (preprocessing.json)"
    units = unit_section(cfg, plan.data, _max_rows(plan))
    records = f"{plan.data.n_train} training rows" if units is None else f"{units['units']} training units"
    text = (
        f"the released weights (model.pt){pre}, as a function of the {records}, protecting "
        f"{unit_covers(units)}: all {ledger.steps} charged DP-SGD steps"
        f"{'' if plan.prep.public else ' and the preprocessing release'} are in the ledger. Not covered: "
        "everything in the report's non_private section (test metrics, a non-private release about the "
        "held-out rows; the non-private baseline; any audit) and the dataset fingerprint. N (the number "
        f"of {'units' if units else 'rows'}) and the label set are public by declaration"
    )
    pretrained = getattr(plan.net, "veil_pretrained", None)
    if pretrained is not None:
        text += (
            f". The initial weights ({pretrained['checkpoint']}, sha256 {pretrained['sha256'][:12]}…) are "
            "public by the user's declaration (--init-from): they cost nothing only if they were trained "
            "without these rows"
        )
    if cfg.reproducible:
        text += f". {RESEARCH_CAVEAT[0].upper()}{RESEARCH_CAVEAT[1:]}: not release-ready"
    return text


def _max_rows(plan: RunPlan) -> int:
    """K of a privacy-unit run: the configured one, or the default rule on the batch size."""
    from veil.units import default_max_rows_per_unit

    assert plan.cfg.batch_size is not None
    return plan.cfg.max_rows_per_unit or default_max_rows_per_unit(plan.cfg.batch_size)


def _write_outputs(
    report: Report,
    run_dir: Path,
    model: nn.Module,
    curve: list[tuple[int, float]],
    encoder: Any = None,
    ledger: Ledger | None = None,
) -> None:
    """``model.pt`` (and a table's ``encoder.json``), the plots, ``report.html`` and last ``report.json``,
    each written atomically; then ``release/`` (the model and the public report) and the folder sealed
    owner-only (:func:`veil.report.publish.publish`)."""
    import json

    from veil.registry.charge import budget_section_for
    from veil.report.html import render_html
    from veil.report.plots import curves_png, epsilon_png
    from veil.report.publish import publish
    from veil.report.train_report import train_report

    events = ledger.events() if ledger is not None else []
    run_id = ledger.header.get("budget_run_id") if ledger is not None else None
    full = train_report(report, events, budget_section_for(run_id, events, run_dir))
    eps_png = epsilon_png(curve, report.target_epsilon, report.steps, report.delta)
    curves = curves_png(report.history["dp"], report.history["baseline"])
    page = render_html(
        report,
        {
            "ε spent against the step": eps_png,
            "Internal, non-private (not covered by the guarantee): test loss and accuracy per epoch, "
            "DP model against the non-private baseline": curves,
        },
        summary=full["summary"],
        dataset_budget=full["dataset_budget"],
    )
    weights = model_bytes(model)
    extra: dict[str, bytes | str] = {"encoder.json": encoder.to_json()} if encoder is not None else {}
    if "preprocessing.json" in report.files and (run_dir / "preprocessing.json").is_file():
        extra["preprocessing.json"] = (run_dir / "preprocessing.json").read_bytes()
    write_files(
        run_dir,
        {
            "model.pt": weights,
            **({"encoder.json": extra["encoder.json"]} if "encoder.json" in extra else {}),
            "epsilon.png": eps_png,
            "curves.png": curves,
            "report.html": page,
            "report.json": json.dumps(full, indent=2, allow_nan=False) + "\n",
        },
    )
    publish(run_dir, full, {"model.pt": weights, **extra})


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def _open_charge(cfg: TrainConfig, *, refuse_if_spent: bool = True) -> DatasetCharge:
    """The dataset's account in the budget registry, opened before a row is read, through the
    pipeline's private-data path (:mod:`veil.pipeline.private_data`: the one identity resolver)."""
    from veil.pipeline.private_data import data_ref, open_account

    try:
        return open_account(data_ref(cfg.dataset, cfg), job="train", refuse_if_spent=refuse_if_spent).charge
    except (DataError, InvalidParameterError):
        # A dataset that cannot be identified (a missing file, ...): the loader's own message says why.
        # Should the loader accept it, the identity error stands: no run is left unrecorded.
        _prepare(cfg, None, check=False)
        raise


def _check_declarations(cfg: TrainConfig) -> None:
    """Refuse what is wrong in the user's own files before the budget check, which could otherwise
    hide it behind "budget exhausted": today the table schema (syntax, types, reviewed). Reads no row."""
    if cfg.table_schema is not None:
        from veil.tables.schema import load_schema

        load_schema(cfg.table_schema).require_reviewed(cfg.table_schema)


def _planned_events(
    plan: RunPlan, spent: list[PrivacyEvent] | None = None, done: int = 0
) -> list[PrivacyEvent]:
    """What the run may still release on top of ``spent``: its preprocessing, then the allowed steps."""
    steps = SelfComposed(plan.steps.step_event, max(plan.allowed - done, 0))
    return [*(plan.prepared.pre_events if spent is None else spent), steps]


def _resume(run_dir: Path, overrides: Mapping[str, Any], progress: bool | None, t0: float) -> Report:
    if not (run_dir / LEDGER).is_file() or not (run_dir / CONFIG).is_file():
        raise CheckpointError(
            "resume",
            str(run_dir),
            "there is no veil run in this folder (no ledger.jsonl and config.toml), so nothing to continue",
            "pass the --out folder of an earlier veil train run",
        )
    with RunLock(run_dir):
        saved = make_config(load_config_file(run_dir / CONFIG), source="saved config")
        update = ckpt.check_overrides(saved, overrides)
        cfg = saved.model_copy(update={**update, "out": str(run_dir)})
        if cfg.audit:
            raise ConfigError(
                "audit",
                True,
                "the canaries injected before the interruption were lost with the process, so the "
                "audit's guesses could not be scored against them",
                "run the audit in an uninterrupted run, or audit the finished run with veil audit --run",
            )
        ckpt.verify_files(
            run_dir, Ledger.open(run_dir / LEDGER, repair=False) if ckpt.intact(run_dir) else None
        )
        ledger = Ledger.open(run_dir / LEDGER, repair=True)
        charge = _open_charge(cfg, refuse_if_spent=False)  # its own reservation is part of the spend
        resumed = False
        try:
            plan = _prepare(cfg, run_dir, check=False)
            ckpt.check_header(ledger.header, _header(plan))
            state = ckpt.load_checkpoint(run_dir, ledger)
            if state is not None:
                now = ckpt.front_fingerprint(plan.net, plan.data.input_shape)
                ckpt.check_front_fingerprint(state, now, run_dir)
            run_id = ledger.header.get("budget_run_id") or uuid.uuid4().hex
            charge.resume(run_id, _planned_events(plan, ledger.events(), ledger.steps), cfg.delta)
            resumed = True
            ledger.append("resume", charged=ledger.steps)
            try:
                return _execute(plan, run_dir, ledger, t0, progress)
            except KeyboardInterrupt as exc:
                raise RunInterrupted(str(run_dir)) from exc
        finally:
            ledger.close()
            if resumed:
                charge.settle(ledger.events())
            charge.close()


def train(
    config: TrainConfig | Mapping[str, Any] | None = None,
    *,
    resume: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> Report:
    """Run ``veil train``: DP training to the configured target, returning the :class:`Report`.

    ``config``: a :class:`~veil.config.TrainConfig` or a dict of its fields (unset ones take the
    defaults and tuned presets). ``resume``: the folder of an interrupted run to continue; ``config``
    may then only repeat its settings (or change performance-only ones). ``progress``: force the
    progress bar on or off (default: on when stdout is a terminal). See the module docstring for the
    guarantee.
    """
    t0 = time.monotonic()
    if resume is not None:
        if isinstance(config, TrainConfig):
            overrides: dict[str, Any] = {k: getattr(config, k) for k in config.model_fields_set}
        else:
            overrides = dict(make_config(config or {}).model_dump(exclude_unset=True))
        return _resume(Path(resume), overrides, progress, t0)
    cfg = config if isinstance(config, TrainConfig) else make_config(config or {})
    _check_declarations(cfg)  # mistakes found without the data come before the budget's verdict
    _check_public(cfg)  # what needs no row is refused before anything is charged
    charge = _open_charge(cfg)  # refuses an exhausted dataset before a row is read
    try:
        run_id = uuid.uuid4().hex
        # Admission before reading: the stand-in (the target ε at δ; the plan itself needs N). Refused:
        # nothing read, nothing recorded.
        charge.reserve(stand_in_plan(cfg.epsilon, cfg.delta), run_id, cfg.delta, before_reading=True)
        ledger: Ledger | None = None
        try:
            charge.reading()  # from here the run stays charged, whatever happens
            plan = _prepare(cfg, None)
            # Before the folder exists: an accounting failure leaves nothing behind.
            curve = _curve(plan, None)
            # The whole plan against the dataset's budget, before anything is written or released.
            charge.replan(_planned_events(plan), cfg.delta)
            run_dir = plan.out
            run_dir.mkdir(parents=True, exist_ok=True)
            with RunLock(run_dir):
                header = {**_header(plan), "budget_run_id": run_id, "budget_dataset_id": charge.identity.id}
                ledger = Ledger.create(run_dir / LEDGER, header)  # exclusive: never over another run
                try:
                    write_config(plan.cfg, run_dir / CONFIG)
                    return _execute(plan, run_dir, ledger, t0, progress, curve)
                except KeyboardInterrupt as exc:  # Ctrl-C: the ledger holds every step; say how to go on
                    raise RunInterrupted(str(run_dir)) from exc
                finally:
                    ledger.close()
        finally:
            # What the ledger holds is what was released; no ledger: the plan (or the stand-in) stays.
            if ledger is None:
                charge.release()
            else:
                charge.settle(ledger.events())
    finally:
        charge.close()


def _check_public(cfg: TrainConfig) -> None:
    """The checks that need no private row (the privacy unit's combinations, the device's precision,
    the output folder), run before the run is charged: such bad input is refused for free."""
    from veil.pipeline.units import check_unit_request
    from veil.precision import autocast

    check_unit_request(cfg, "veil train", supported=True)  # --stream/--audit/ranks with a unit
    autocast(cfg.device, cfg.precision)
    check_out(Path(cfg.out or default_out(cfg.dataset)))
