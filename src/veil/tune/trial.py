"""One ``veil tune`` trial: a full DP training run through the train job's pipeline, then its DP score.

The trial trains on the private training split (by default all of it; with a validation share, minus a
held-out part fixed for the whole tuning run, each row on its side by a keyed hash of that row alone),
with the σ the budget split gave its shape and every step charged to its own ledger
(``trials/<i>/ledger.jsonl``) by the train job's loop. Its score is the number of scored examples (the
training rows by default, else the held-out ones) the released model classifies correctly plus
Gaussian noise (sensitivity 1 under add/remove-one: one record changes the count by at most one), drawn
from the OS CSPRNG on the secure lattice; the score's event is appended to the trial's ledger before the
noise is drawn."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.ledger import Ledger, RunLock
from veil.config import TrainConfig, write_config
from veil.errors import BudgetExhaustedError
from veil.mechanisms.gaussian import gaussian_event, gaussian_mechanism
from veil.mechanisms.rng import make_source
from veil.pipeline.budget import allowed_steps, plan_steps
from veil.pipeline.data import Prepared, prepare
from veil.pipeline.loop import RunPlan
from veil.pipeline.model import assemble, build_net
from veil.pipeline.run_folder import CONFIG, LEDGER
from veil.tune.units import correct_count

if TYPE_CHECKING:
    from veil.accounting.events import PrivacyEvent
    from veil.tune.budget import ShapePlan
    from veil.tune.space import Candidate

__all__ = ["prepare_trial", "run_reference", "run_trial", "score_event"]


def score_event(score_noise: float) -> PrivacyEvent:
    """The event of one noisy correct-count (std ``score_noise``, sensitivity 1, secure lattice)."""
    return gaussian_event(1.0, score_noise, coordinates=1, secure=True)


def prepare_trial(
    cfg: TrainConfig, validation: np.ndarray | None, plan_size: int | None = None
) -> tuple[Prepared, np.ndarray, np.ndarray]:
    """:func:`split_trial` without the validation rows' units."""
    prepared, x_val, y_val, _ = split_trial(cfg, validation, plan_size)
    return prepared, x_val, y_val


def split_trial(
    cfg: TrainConfig, validation: np.ndarray | None, plan_size: int | None = None
) -> tuple[Prepared, np.ndarray, np.ndarray, np.ndarray | None]:
    """The train job's preparation, the training split then cut into (training, validation).

    ``validation``: a boolean mask over the full training split (``None``: only load, for sizing).
    Returns the prepared inputs (preprocessing planned on what the trial trains on) and the
    validation features, labels and unit keys (None without a privacy unit). With a privacy unit the
    mask holds whole units (:func:`veil.tune.run.validation_mask`) and the trial's units are kept
    with its rows. ``plan_size``: the public size the trial's steps are planned on (q = B /
    plan_size, :func:`veil.tune.run.planned_size`), never the part's exact size, which depends on
    which side of the keyed split each record fell (:attr:`veil.pipeline.data.Prepared.plan_size`)."""
    from veil.data.preprocess import plan_preprocessing

    prepared = prepare(cfg, units=True)
    data = prepared.data
    if validation is None:
        return prepared, data.x_train[:0], data.y_train[:0], None
    x_val, y_val = data.x_train[validation], data.y_train[validation]
    units_val = None if data.units_train is None else data.units_train[validation]
    prepared.data = dataclasses.replace(
        data,
        x_train=data.x_train[~validation],
        y_train=data.y_train[~validation],
        units_train=None if data.units_train is None else data.units_train[~validation],
    )
    prepared.prep = plan_preprocessing(prepared.cfg, prepared.data)
    prepared.plan_size = plan_size
    return prepared, x_val, y_val, units_val


def trial_config(
    base: dict[str, Any], cand: Candidate, shape: ShapePlan, cap: float, out: Path
) -> TrainConfig:
    """The train job's config for one trial: the candidate, the shape's σ, a per-trial cap that lets
    every planned step run (the tuning total is what limits the procedure), RDP accounting."""
    from veil.config import make_config

    return make_config(
        {
            **base,
            **cand.to_dict(),
            "noise_multiplier": shape.sigma,
            "epsilon": cap,
            "accountant": "rdp",
            "baseline": False,
            "progress": False,
            "audit": False,
            "out": str(out),
        }
    )


def _checked_plan(prepared: Any, out: Path) -> RunPlan:
    """The train job's step plan, network and example-mixing check for a trial or the reference, as
    ``veil train`` makes them (the same functions), before anything is written."""
    from veil.pipeline.public_inputs import refuse_mixing_on_public_inputs

    cfg = prepared.cfg
    steps = plan_steps(cfg, prepared.n_planned, prepared.pre_events)
    allowed = allowed_steps(cfg, steps.sigma, steps.q, steps.steps_planned, prepared.pre_events)
    net = build_net(cfg, prepared.data, cfg.seed)
    plan = RunPlan(prepared, net, steps, allowed, out)
    refuse_mixing_on_public_inputs(assemble(plan.prep, plan.data.input_shape, net), plan.data, cfg.seed)
    return plan


def remove_weights(out: Path) -> None:
    """Delete every weight file under the reference's folder (its ``model.pt`` and checkpoints)."""
    for weights in out.rglob("*.pt"):
        weights.unlink(missing_ok=True)


def run_trial(
    cfg: TrainConfig,
    validation: np.ndarray,
    shape: ShapePlan,
    score_noise: float,
    out: Path,
    score_on_training: bool = False,
    score_over: float = 1.0,
    plan_size: int | None = None,
) -> dict[str, Any]:
    """Train one candidate (every step charged to ``out/ledger.jsonl``), then release its noisy score.

    The released score is the noisy count divided by ``score_over``, a public number (the expected
    number of scored records, F·N with the validation share F, or N when scoring on the training rows:
    :attr:`veil.tune.plan.TrialPlan.n_validation`), never by the exact count of scored records, which
    is a function of the private rows (a record's side of the keyed-hash split): post-processing of
    the noisy count alone. The exact count stays in the trial's internal ledger.

    ``score_on_training``: no row is held out (``validation`` is all False); the score counts the
    correct predictions on the rows the trial trained on. Privacy is the same: given the released
    model, one record moves that count by at most one (sensitivity 1), and the count's Gaussian event
    composes with the trial's DP-SGD steps on the same rows, as the held-out count does. It is a
    training score, not a held-out estimate: a DP model generalises (its training accuracy is close to
    its test accuracy), which is what makes it usable for choosing among candidates.

    ``plan_size``: the public size the steps are planned on (:func:`split_trial`)."""
    import torch

    from veil.training.execute import execute_run
    from veil.training.prepare import run_header

    t0 = time.monotonic()
    prepared, x_val, y_val, units_val = split_trial(cfg, validation, plan_size)
    if score_on_training:
        data = prepared.data
        x_val, y_val, units_val = data.x_train, data.y_train, data.units_train
    cfg = prepared.cfg
    plan = _checked_plan(prepared, out)
    steps = plan.steps
    if (steps.q, steps.steps_planned, steps.sigma) != (shape.q, shape.steps, shape.sigma):
        raise BudgetExhaustedError(  # pragma: no cover - the plan and the trial size the data alike
            "trial",
            cfg.batch_size,
            "the trial would not run the steps its budget share was planned for",
            "report this as a bug",
        )
    out.mkdir(parents=True, exist_ok=False)
    with RunLock(out):
        ledger = Ledger.create(out / LEDGER, {**run_header(plan), "job": "tune-trial"})
        try:
            write_config(cfg, out / CONFIG)
            # no release/: a trial's own report claims its own guarantee, which the tuning bound does
            # not give when more than the chosen model is published; its model.pt stays in the
            # owner-only folder, for the chosen one to be copied out
            report = execute_run(plan, out, ledger, t0, False, release=False)
            model = assemble(plan.prep, plan.data.input_shape, build_net(cfg, plan.data, cfg.seed))
            model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
            model.eval()
            with torch.no_grad():  # in chunks: a fixed front on 12,000 images at once needs > 10 GB
                pred = np.concatenate(
                    [
                        model(torch.from_numpy(x_val[i : i + 1024])).argmax(dim=1).numpy()
                        for i in range(0, len(x_val), 1024)
                    ]
                    or [np.zeros(0, dtype=np.int64)]
                )
            correct = correct_count(pred == y_val, units_val)
            event = score_event(score_noise)
            ledger.append("event", label="validation_score", event=event.to_dict())
            noisy = gaussian_mechanism(correct, sensitivity=1.0, std=score_noise, rng=make_source(True))
            assert noisy.event == event
            n_val = len(y_val) if units_val is None else len(np.unique(units_val))
            ledger.append("score", noisy_correct=float(noisy.value), n_validation=n_val)
            events = ledger.events()
        finally:
            ledger.close()
    return {
        "noisy_score": float(noisy.value) / max(score_over, 1.0),  # a public denominator
        "sigma": steps.sigma,
        "steps": ledger.steps,
        "sampling_rate": steps.q,
        "test_accuracy": report.test_accuracy,
        "events": events,
        "duration_s": time.monotonic() - t0,
    }


def run_reference(cfg: TrainConfig, out: Path) -> dict[str, Any]:
    """``veil train`` with the preset on the whole training split at the tuning target ε (its own σ
    calibration and ledger, ``job: tune-reference``), for the report's non-private comparison only.

    Not covered by the tuning guarantee, charged nowhere and never released: it writes no
    ``release/`` folder at all (:func:`veil.training.execute.execute_run` with ``release=False``),
    and its weights (``model.pt``, checkpoints) are deleted when it ends, also when it fails
    (``finally``); only its test accuracy is kept, in the report's ``non_private`` section (as
    ``veil train``'s non-private baseline is). A process killed outright (SIGKILL) may leave
    checkpoints in the owner-only ``reference/`` folder, never a folder that looks releasable."""
    from veil.training.execute import execute_run
    from veil.training.prepare import run_header

    t0 = time.monotonic()
    prepared, _, _, _ = split_trial(cfg, None)
    cfg = prepared.cfg
    plan = _checked_plan(prepared, out)
    out.mkdir(parents=True, exist_ok=False)
    try:
        with RunLock(out):
            ledger = Ledger.create(out / LEDGER, {**run_header(plan), "job": "tune-reference"})
            try:
                write_config(cfg, out / CONFIG)
                report = execute_run(plan, out, ledger, t0, False, release=False)
            finally:
                ledger.close()
    finally:
        remove_weights(out)  # never released: only its test accuracy is reported
    return {
        "lr": cfg.lr,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "max_grad_norm": cfg.max_grad_norm,
        "model": prepared.model_name,
        "sigma": plan.steps.sigma,
        "steps": ledger.steps,
        "test_accuracy": report.test_accuracy,
        "duration_s": time.monotonic() - t0,
    }
