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
from pathlib import Path
from typing import Any

from veil.accounting.events import PrivacyEvent, SelfComposed
from veil.accounting.ledger import Ledger, RunLock
from veil.config import TrainConfig, load_config_file, make_config, write_config
from veil.errors import CheckpointError, ConfigError, DataError, InvalidParameterError, RunInterrupted
from veil.pipeline import checkpoints as ckpt
from veil.pipeline.data import check_declarations
from veil.pipeline.loop import RunPlan
from veil.pipeline.private_data import stand_in_plan
from veil.pipeline.run_folder import CONFIG, LEDGER, check_out, default_out
from veil.registry.charge import DatasetCharge
from veil.report import Report
from veil.training.execute import execute_run, planned_curve
from veil.training.prepare import prepare_run, run_header

__all__ = ["Report", "train"]


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
        prepare_run(cfg, None, check=False)
        raise


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
        report: Report | None = None
        try:
            # A copy of the folder that cannot continue the run is refused before a row is read.
            if ledger.header.get("budget_run_id"):
                charge.check_resume(ledger.header["budget_run_id"], run_dir, len(ledger.records))
            plan = prepare_run(cfg, run_dir, check=False)
            ckpt.check_header(ledger.header, run_header(plan))
            state = ckpt.load_checkpoint(run_dir, ledger)
            if state is not None:
                now = ckpt.front_fingerprint(plan.net, plan.data.input_shape)
                ckpt.check_front_fingerprint(state, now, run_dir)
            run_id = ledger.header.get("budget_run_id") or uuid.uuid4().hex
            planned = _planned_events(plan, ledger.events(), ledger.steps)
            # Refused if another copy of this folder resumed the run since, or if this ledger is
            # older than the one the run was settled with (veil.registry.resume_lease).
            charge.resume(run_id, planned, cfg.delta, folder=run_dir, ledger_records=len(ledger.records))
            resumed = True
            ledger.append("resume", charged=ledger.steps)
            try:
                report = execute_run(plan, run_dir, ledger, t0, progress)
                return report
            except KeyboardInterrupt as exc:
                raise RunInterrupted(str(run_dir)) from exc
        finally:
            ledger.close()
            if resumed:
                _settle(charge, ledger, completed=report is not None)
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
    check_declarations(cfg)  # mistakes found without the data come before the budget's verdict
    _check_public(cfg)  # what needs no row is refused before anything is charged
    charge = _open_charge(cfg)  # refuses an exhausted dataset before a row is read
    try:
        run_id = uuid.uuid4().hex
        # Admission before reading: the stand-in (the target ε at δ; the plan itself needs N). Refused:
        # nothing read, nothing recorded.
        charge.reserve(stand_in_plan(cfg.epsilon, cfg.delta), run_id, cfg.delta, before_reading=True)
        ledger: Ledger | None = None
        report: Report | None = None
        try:
            charge.reading()  # from here the run stays charged, whatever happens
            plan = prepare_run(cfg, None)
            # Before the folder exists: an accounting failure leaves nothing behind.
            curve = planned_curve(plan, None)
            # The whole plan against the dataset's budget, before anything is written or released.
            charge.replan(_planned_events(plan), cfg.delta)
            run_dir = plan.out
            run_dir.mkdir(parents=True, exist_ok=True)
            with RunLock(run_dir):
                header = {
                    **run_header(plan),
                    "budget_run_id": run_id,
                    "budget_dataset_id": charge.identity.id,
                }
                ledger = Ledger.create(run_dir / LEDGER, header)  # exclusive: never over another run
                try:
                    write_config(plan.cfg, run_dir / CONFIG)
                    report = execute_run(plan, run_dir, ledger, t0, progress, curve)
                    return report
                except KeyboardInterrupt as exc:  # Ctrl-C: the ledger holds every step; say how to go on
                    raise RunInterrupted(str(run_dir)) from exc
                finally:
                    ledger.close()
        finally:
            # A finished run: what its ledger holds is what was released. No ledger, or a run that
            # stopped before its end: the plan (or the stand-in) stays charged.
            if ledger is None:
                charge.release()
            else:
                _settle(charge, ledger, completed=report is not None)
    finally:
        charge.close()


def _settle(charge: DatasetCharge, ledger: Ledger, *, completed: bool) -> None:
    """Settle a run that wrote a ledger: a finished run (including one the budget stopped early, a
    decision made from public numbers) with its ledger's events; a run that stopped before its end (an
    interrupt, a crash) with its whole plan. An interrupt may follow the training loss on the progress
    bar, computed without noise, so charging only the steps taken would make the refund depend on the
    data (revD's F7); ``--resume`` continues such a run at no further charge. The ledger's length is
    kept so that an older copy of the folder is never resumed (:mod:`veil.registry.resume_lease`)."""
    if completed:
        charge.settle(ledger.events(), len(ledger.records))
    else:
        charge.release(len(ledger.records))


def _check_public(cfg: TrainConfig) -> None:
    """The checks that need no private row (the privacy unit's combinations, a target ε the
    scattering preset's Gram release alone reaches on a built-in dataset, the device's precision,
    the output folder, a model that mixes examples where the schema describes the data), run before
    the run is charged: such bad input is refused for free."""
    from veil.distributed.runtime import rank_and_world
    from veil.pipeline.data import refuse_whitening_over_target
    from veil.pipeline.public_inputs import refuse_mixing_before_reading
    from veil.pipeline.units import check_unit_request
    from veil.precision import autocast

    check_unit_request(cfg, "veil train", supported=True)  # --stream/--audit/ranks with a unit
    refuse_whitening_over_target(cfg, whiten=rank_and_world()[1] == 1)  # as prepare_run plans it
    _refuse_augment_without_images(cfg)
    if cfg.model.startswith("hf:"):  # the model folder is public: weights, tokenizer, memory, max_length
        from veil.text.data import check_model_folder

        check_model_folder(cfg.model, cfg.fine_tune, cfg.device, cfg.max_length)
    autocast(cfg.device, cfg.precision)
    check_out(Path(cfg.out or default_out(cfg.dataset)))
    refuse_mixing_before_reading(cfg)  # a model that mixes examples, told from the schema alone


def _refuse_augment_without_images(cfg: TrainConfig) -> None:
    """``--augment K > 1`` on data that is no image, told from the settings alone (a table's reviewed
    schema, a text model, a built-in dataset's documented shape and the model it gets): refused before
    the run is charged. The same rule runs again on the loaded
    data (:func:`veil.training.prepare.refuse_unsupported_augment`) for what only the data's shape says."""
    from veil.data import BUILTIN_SHAPES

    if cfg.augment <= 1:
        return
    what = "a table (--schema)" if cfg.table_schema is not None else None
    if what is None and cfg.model.startswith("hf:"):
        what = "text (--model hf:...)"
    if what is not None:
        raise ConfigError(
            "augment",
            cfg.augment,
            f"augmentation multiplicity shifts and flips images, and this data is {what}",
            "drop --augment for tables and text",
        )
    if cfg.dataset in BUILTIN_SHAPES and cfg.init_from is None:  # kind and shape are documented
        from veil.augment.multiplicity import refuse_unsupported
        from veil.models import resolve_name

        kind, shape = BUILTIN_SHAPES[cfg.dataset]
        name = resolve_name(cfg.model, kind, shape)
        fixed = kind == "image" and _has_fixed_front(name, kind, shape)
        refuse_unsupported(cfg.augment, kind, shape, name, fixed)


def _has_fixed_front(name: str, kind: str, shape: tuple[int, ...]) -> bool:
    """Whether the model trains as a head on fixed features: a zoo name says it; a user's factory is
    called once here on the built-in dataset's documented shape (its code is public; no row is read),
    so that ``--augment`` on it is refused before the charge like the zoo's."""
    import torch

    from veil.models import FIXED_FRONT_ZOO, FixedFeaturesThenHead, build_model

    if ":" not in name:
        return name in FIXED_FRONT_ZOO
    with torch.random.fork_rng(devices=[]):
        probe = build_model(name, shape, _BUILTIN_IMAGE_CLASSES, kind)
    return isinstance(probe, FixedFeaturesThenHead)


_BUILTIN_IMAGE_CLASSES = 10  # digits, MNIST and Fashion-MNIST (documented; only images reach the probe)
