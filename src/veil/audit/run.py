"""``veil audit`` as functions: train with canaries and attack the model, or attack a finished run.

:func:`audit` trains through veil's pipeline (:mod:`veil.audit.fit`: the same data loading, split,
presets, preprocessing, model zoo and :class:`~veil.PrivacyEngine` as ``veil train``, σ calibrated
to the target or given, or σ = 0 for a non-private reference run) with canaries, then

* ``canary``: scores the canaries and reports the one-run ε lower bound at the stated confidence
  (:mod:`veil.audit.bounds`), together with the loss-threshold attack (free: no retraining);
* ``loss``: the loss-threshold attack only (a plain run, no canaries);
* ``lira``: LiRA with shadow models trained by the same pipeline on random halves of the pool
  (training split + clean held-out examples), plus the loss attack;
* ``all``: everything.

:func:`audit_run` attacks the ``model.pt`` of a finished ``veil train`` run (loss attack, and LiRA
with shadows if asked), re-creating the run's split from its ``config.toml`` and checking the data
fingerprint against its ``report.json``. Shadow models reuse the target's σ.

``veil train --audit`` uses :mod:`veil.audit.hook` (:func:`run_one_run_audit`, re-exported here).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.audit.attacks import membership_attacks, mia_section, plots
from veil.audit.canaries import GradientCanaries
from veil.audit.coordinates import max_gradient_canaries
from veil.audit.fit import Fit, Setup, fit, make_model, prepare_audit, sigma_for, theoretical_epsilon
from veil.audit.hook import OneRunAudit, check_delta_room, delta_cap, run_one_run_audit
from veil.audit.input_canaries import InputCanaries, max_input_canaries
from veil.audit.report import reading, verdict
from veil.audit.settings import (
    DEFAULT_INPUT_CANARIES,
    AuditReport,
    AuditSettings,
    resolve_audit_config,
    settings_from,
)
from veil.errors import DataError, InvalidParameterError
from veil.pipeline.outputs import finite
from veil.pipeline.randomness import private_source, randomness_of
from veil.pipeline.run_folder import check_out, default_out, write_files
from veil.pipeline.seeds import Purpose

if TYPE_CHECKING:
    from torch import nn

    from veil.audit.bounds import OneRunBound
    from veil.config import TrainConfig
    from veil.engine import PrivacyEngine
    from veil.mechanisms.rng import RandomSource
    from veil.optimizer import DPOptimizer

__all__ = [
    "AuditReport",
    "AuditSettings",
    "OneRunAudit",
    "audit",
    "audit_run",
    "resolve_audit_config",
    "run_one_run_audit",
    "settings_from",
]

RUN_FILES = ("report.json", "config.toml", "model.pt")


# ---------------------------------------------------------------------------------------------
# Report files
# ---------------------------------------------------------------------------------------------
def _write(report: AuditReport, out: Path, images: Mapping[str, tuple[str, bytes]]) -> None:
    """``report.json``, ``report.html`` and the plots, each written atomically, owner-only: an audit
    writes no ``release/`` (nothing in it is released under a guarantee)."""
    from veil.audit.report import render_html

    files = {"report.json": "this report, machine-readable", "report.html": "this report as a page"}
    files.update({name: title for name, (title, _) in images.items()})
    report.files = files
    report.out_dir = str(out)
    full = finite(report.to_dict())
    html = render_html(full, {title: png for title, png in images.values()})
    # Everything is computed before the first file is written; the report last.
    write_files(
        out,
        {
            **{name: png for name, (_, png) in images.items()},
            "report.html": html,
            "report.json": report.to_json(),
        },
    )
    # An audit releases nothing (revH's H7): every figure, its verdict included, is computed from the
    # private data without noise, so no release/ folder; the whole folder is owner-only.
    from veil.pipeline.run_folder import seal

    seal(out)


def _dataset_budget(cfg: TrainConfig, out: Path) -> dict[str, Any] | None:
    """The audited dataset's ``dataset_budget`` from the registry (an audit itself charges nothing)."""
    from veil.registry.charge import budget_section_for
    from veil.registry.identity import dataset_identity

    try:
        identity = dataset_identity(
            cfg.dataset,
            dataset_id=cfg.dataset_id,
            table=getattr(cfg, "table", None),
            query=getattr(cfg, "query", None),
            data_dir=cfg.data_dir,
        )
    except (DataError, InvalidParameterError):  # read already: cannot happen short of a race
        return None
    return budget_section_for(None, None, out, dataset_id=identity.id)


def _version() -> str:
    import veil

    return str(veil.__version__)


# ---------------------------------------------------------------------------------------------
# veil audit: train with canaries, then attack
# ---------------------------------------------------------------------------------------------
@dataclass
class _Canaries:
    """The canaries of an audit, designed before any training: input canaries join the training
    records (a zero-weight record when excluded); gradient canaries attach after make_private."""

    inputs: InputCanaries | None
    x: np.ndarray
    y: np.ndarray
    w: np.ndarray
    nonmembers: tuple[np.ndarray, np.ndarray]
    grads: list[GradientCanaries]


def _check_gradient_room(setup: Setup, settings: AuditSettings) -> None:
    """An explicit gradient canary count must fit the model (None: chosen from the model)."""
    if not settings.gradient or settings.canaries is None:
        return
    limit = max_gradient_canaries(make_model(setup, setup.cfg.seed), settings.canary_direction)
    if settings.canaries > limit:
        raise InvalidParameterError(
            "canaries",
            settings.canaries,
            f"the model has room for {limit} gradient canaries "
            f"({'one coordinate each' if settings.canary_direction == 'dirac' else 'within memory'})",
            f"pass --canaries ≤ {limit}",
        )


def _design_canaries(setup: Setup, settings: AuditSettings, rng: RandomSource) -> _Canaries:
    """Check every canary count, then design the input canaries (all before any training)."""
    cfg, data = setup.cfg, setup.data
    _check_gradient_room(setup, settings)
    n_in = 0
    if settings.input:
        limit = max_input_canaries(data.n_test)
        n_in = settings.canaries if settings.canaries is not None else min(DEFAULT_INPUT_CANARIES, limit)
        if n_in > limit or n_in < 1:
            raise InvalidParameterError(
                "canaries",
                n_in,
                f"input canaries are held-out examples with a wrong label; there are {data.n_test} held-out "
                "examples and half must stay clean non-members",
                f"pass --canaries ≤ {limit}, or --canary-kind gradient",
            )
    check_delta_room(max(n_in, (settings.canaries or 0) if settings.gradient else 0), cfg.delta)
    inputs = InputCanaries.design(data.x_test, data.y_test, n_in, data.num_classes, rng=rng) if n_in else None
    clean = np.ones(data.n_test, dtype=bool)
    x, y, w = data.x_train, data.y_train, np.ones(data.n_train, np.float32)
    if inputs is not None:
        clean[inputs.source] = False
        x = np.concatenate([x, inputs.x.astype(x.dtype)])
        y = np.concatenate([y, inputs.y.astype(y.dtype)])
        w = np.concatenate([w, inputs.weights()])
    return _Canaries(inputs, x, y, w, (data.x_test[clean], data.y_test[clean]), [])


def _attach(setup: Setup, settings: AuditSettings, canaries: _Canaries, rng: RandomSource) -> Any:
    """The ``before`` hook of :func:`~veil.audit.fit.fit` that attaches the gradient canaries."""
    cfg, data = setup.cfg, setup.data

    def attach(model: nn.Module, optimizer: DPOptimizer, engine: PrivacyEngine, inputs: np.ndarray) -> None:
        assert cfg.max_grad_norm is not None and engine.sampling_rate is not None
        design = GradientCanaries.design(
            model,
            settings.canaries,
            rng=rng,
            max_grad_norm=cfg.max_grad_norm,
            direction=settings.canary_direction,
            sample=(inputs[: data.n_train], data.y_train),  # the training records come first
            expected_batch_size=optimizer.expected_batch_size,
            noise_multiplier=optimizer.noise_multiplier,
            cap=delta_cap(cfg.delta),
        )
        design.attach(optimizer, sampling_rate=engine.sampling_rate)
        canaries.grads.append(design)

    return attach if settings.gradient else None


def _score_canaries(
    setup: Setup, settings: AuditSettings, canaries: _Canaries, target: nn.Module
) -> tuple[dict[str, Any] | None, dict[str, tuple[np.ndarray, np.ndarray]], list[OneRunBound]]:
    """The canary section of the report, the score groups for the plot, and the bounds."""
    cfg = setup.cfg
    inputs = canaries.inputs
    kinds = int(settings.gradient) + int(inputs is not None)  # fixed by the settings, before any score
    groups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    bounds: list[OneRunBound] = []
    if not kinds:
        return None, groups, bounds
    section: dict[str, Any] = {
        "count": sum(g.count for g in canaries.grads) + (inputs.count if inputs else 0)
    }
    if canaries.grads:
        g = canaries.grads[0]
        g.detach()
        b = g.bound(settings.confidence, delta=cfg.delta, share=kinds)
        bounds.append(b)
        section["gradient"] = {**g.summary(), "bound": b.to_dict()}
        groups["gradient"] = (g.scores(), g.included)
    if inputs is not None:
        inputs.score(target, device=cfg.device)
        b = inputs.bound(settings.confidence, delta=cfg.delta, share=kinds)
        bounds.append(b)
        section["input"] = {**inputs.summary(), "bound": b.to_dict()}
        assert inputs._scores is not None
        groups["input"] = (inputs._scores, inputs.included)
    return section, groups, bounds


def audit(
    config: TrainConfig | Mapping[str, Any] | None = None,
    settings: AuditSettings | None = None,
    *,
    out: str | Path | None = None,
    write: bool = True,
) -> AuditReport:
    """Train with canaries (per ``settings``), attack the model, write ``report.json``/``.html``.

    ``config``: a :class:`~veil.config.TrainConfig` or a dict of its fields (the training run to
    audit; presets fill the rest). Every check (settings, data, canary counts, output folder) runs
    before training. See the module docstring for what is measured.
    """
    from veil.config import TrainConfig, make_config

    settings = settings or AuditSettings()
    cfg = config if isinstance(config, TrainConfig) else make_config(config or {})
    setup = prepare_audit(cfg, private=not settings.non_private)
    cfg, data = setup.cfg, setup.data
    out_dir = Path(out) if out is not None else default_out(cfg.dataset, "audit")
    if write:
        check_out(out_dir)
    rng = private_source(cfg.reproducible, cfg.seed, Purpose.AUDIT)
    canaries = _design_canaries(setup, settings, rng)
    sigma = sigma_for(setup, len(canaries.y))
    t0 = time.perf_counter()
    trained = fit(
        setup,
        canaries.x,
        canaries.y,
        canaries.w,
        sigma=sigma,
        seed=cfg.seed,
        before=_attach(setup, settings, canaries, rng),
    )
    epsilon_theoretical = theoretical_epsilon(setup, trained)
    target = trained.model
    canary_section, groups, bounds = _score_canaries(setup, settings, canaries, target)
    audit_seconds = time.perf_counter() - t0
    members = (data.x_train, data.y_train)
    attacks, lira_seconds = membership_attacks(
        setup, target, members, canaries.nonmembers, settings, sigma, rng
    )
    lower = max((b.epsilon for b in bounds), default=None)
    mia = mia_section(attacks)
    report = AuditReport(
        epsilon_lower_bound=lower,
        confidence=settings.confidence,
        epsilon_theoretical=epsilon_theoretical,
        delta=cfg.delta,
        canaries=canary_section,
        mia=mia,
        verdict=verdict(lower, epsilon_theoretical),
        reading=reading(lower, epsilon_theoretical, settings.confidence, cfg.delta, mia),
        source=f"veil audit: a {'non-private (σ = 0)' if not setup.private else 'DP'} training run of "
        f"'{setup.model_name}' on '{data.name}', trained by veil's pipeline with the canaries inserted",
        run=_run_info(setup, trained, sigma, len(canaries.y), target, settings),
        timing={
            "training_s": trained.seconds,
            "one_run_audit_s": audit_seconds,
            "shadow_training_s": lira_seconds,
        },
        veil_version=_version(),
        randomness=randomness_of(cfg.reproducible),
    )
    if write:
        report.dataset_budget = _dataset_budget(cfg, out_dir)
        _write(report, out_dir, plots(attacks, groups))
    return report


def _run_info(
    setup: Setup, trained: Fit, sigma: float, records: int, model: nn.Module, settings: AuditSettings
) -> dict[str, Any]:
    from veil.audit.mia import model_logits

    cfg, data = setup.cfg, setup.data
    logits = model_logits(model, data.x_test, device=cfg.device)
    accuracy = float((logits.argmax(1) == data.y_test).mean()) if len(logits) else float("nan")
    return {
        "dataset": data.name,
        "dataset_sha256": data.sha256,
        "model": setup.model_name,
        "n_train": data.n_train,
        "records_in_training_set": records,
        "non_private": not setup.private,
        "target_epsilon": cfg.epsilon if setup.private and cfg.noise_multiplier is None else None,
        "noise_multiplier": sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "batch_size": cfg.batch_size,
        "sampling_rate": trained.engine.sampling_rate,
        "epochs": cfg.epochs,
        "steps": trained.steps,
        "lr": cfg.lr,
        "optimizer": cfg.optimizer or "sgd",
        "accountant": cfg.accountant,
        "seed": cfg.seed,
        "reproducible": cfg.reproducible,
        "test_accuracy": accuracy,
        "attack": settings.attack,
    }


# ---------------------------------------------------------------------------------------------
# veil audit --run DIR: attack a finished veil train run
# ---------------------------------------------------------------------------------------------
def _not_a_run(run: Path, why: str) -> DataError:
    return DataError(
        "run",
        str(run),
        f"this folder is not a finished veil train run ({why}), so the model and its training split "
        "cannot be identified",
        "pass the --out folder of a finished `veil train` run",
    )


def _finished_run(run: Path, settings: AuditSettings) -> tuple[str, float, float]:
    """(data sha256, ε spent, σ) from a finished run's report; refuse what cannot be audited."""
    if not run.is_dir():
        raise _not_a_run(run, "no such folder")
    missing = [f for f in RUN_FILES if not (run / f).is_file()]
    if missing:
        raise _not_a_run(run, f"missing {', '.join(missing)}")
    if settings.attack == "canary":
        raise InvalidParameterError(
            "attack",
            settings.attack,
            "canaries must be inserted while training, and this run is finished",
            "use --attack loss or lira with --run (a new `veil audit` or `veil train --audit` run would "
            "spend the dataset's budget again)",
        )
    try:
        saved = json.loads((run / "report.json").read_text(encoding="utf-8"))
        return (
            str(saved["dataset"]["sha256"]),
            float(saved["epsilon_spent"]),
            float(saved["noise_multiplier"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _not_a_run(run, f"report.json is unreadable: {type(exc).__name__}") from None


def _released_model(setup: Setup, run: Path) -> nn.Module:
    """The run's ``model.pt`` loaded into the configured model; the released preprocessing statistic
    (the DP centre of table features) is kept for the shadows, the rest of the layer is public."""
    import torch

    model = make_model(setup, setup.cfg.seed)
    try:
        state = torch.load(run / "model.pt", map_location=setup.cfg.device, weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:
        raise _not_a_run(
            run, f"model.pt does not load into the configured model: {type(exc).__name__}"
        ) from None
    if "preprocess.offset" in state:
        setup.preprocess_state = {"offset": state["preprocess.offset"]}
    return model


def audit_run(
    run_dir: str | Path,
    settings: AuditSettings | None = None,
    *,
    out: str | Path | None = None,
    write: bool = True,
) -> AuditReport:
    """Attack the released ``model.pt`` of a finished ``veil train`` run (no canaries: they must be
    inserted during training). ``settings.attack``: ``loss`` (default), ``lira`` or ``all`` (both;
    LiRA trains shadow models with the run's own settings and σ)."""
    from veil.config import load_config_file, make_config

    settings = settings or AuditSettings(attack="loss")
    run = Path(run_dir)
    sha, theoretical, sigma = _finished_run(run, settings)
    cfg = make_config(load_config_file(run / "config.toml"), source="run config.toml")
    setup = prepare_audit(cfg, private=True, run_preprocessing=False)
    cfg, data = setup.cfg, setup.data
    if data.sha256 != sha:
        raise DataError(
            "dataset",
            cfg.dataset,
            "the data found now is not the data the run was trained on (sha256 differs), so members and "
            "non-members cannot be told apart",
            "restore the run's dataset",
        )
    out_dir = Path(out) if out is not None else run / "audit"
    if write:
        check_out(out_dir)
    model = _released_model(setup, run)
    members = (data.x_train, data.y_train)
    nonmembers = (data.x_test, data.y_test)
    t0 = time.perf_counter()
    rng = private_source(cfg.reproducible, cfg.seed, Purpose.AUDIT)
    attacks, lira_seconds = membership_attacks(setup, model, members, nonmembers, settings, sigma, rng)
    mia = mia_section(attacks)
    report = AuditReport(
        epsilon_lower_bound=None,
        confidence=settings.confidence,
        epsilon_theoretical=theoretical,
        delta=cfg.delta,
        canaries=None,
        mia=mia,
        verdict=verdict(None, theoretical),
        reading=reading(None, theoretical, settings.confidence, cfg.delta, mia),
        source=f"veil audit --run {run}: the released model of a finished veil train run",
        run={
            "run": str(run),
            "dataset": data.name,
            "dataset_sha256": data.sha256,
            "model": setup.model_name,
            "n_train": data.n_train,
            "noise_multiplier": sigma,
            "epsilon_spent": theoretical,
            "seed": cfg.seed,
            "attack": settings.attack,
        },
        timing={"attacks_s": time.perf_counter() - t0, "shadow_training_s": lira_seconds},
        veil_version=_version(),
        randomness=randomness_of(cfg.reproducible),
    )
    if write:
        report.dataset_budget = _dataset_budget(cfg, out_dir)
        _write(report, out_dir, plots(attacks, {}))
    return report
