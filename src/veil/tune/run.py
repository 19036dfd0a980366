"""``veil tune`` as a function: private hyperparameter tuning by random stopping.

Flow: config → by default no row held out (each trial trains on the whole training split and is
scored on those rows); with ``validation_fraction`` > 0 the split cut once into (training, validation)
by a keyed hash of each record (:func:`validation_mask`) → the trial shapes' σ from the budget split
(:mod:`veil.tune.budget`) → K drawn from the trial-count law (OS CSPRNG) → K trials, each a full DP
training run through the train job's loop with its own ledger, then its noisy correct count → the
candidate with the best noisy score is released (``model.pt``) → ``report.json`` and ``report.html``.

Guarantee. The chosen model, its hyperparameters and its noisy score are (ε, δ)-DP for
the training split (every row, whichever part it is in) under add/remove-one neighbouring (of a
unit with all its rows with ``privacy_unit``: :mod:`veil.tune.units`), where
ε is the random-stopping bound of :mod:`veil.accounting.tuning` over the largest RDP curve of any
trial the space allows (preprocessing, every DP-SGD step, the score), never the best trial's own ε.
Not covered, and labelled ``non_private`` in the report: the number of trials K, the other trials
(their hyperparameters, scores and models under ``trials/``) and every test accuracy. Releasing K
or the other trials voids the bound; only the chosen model is meant for release.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.defaults import DEFAULT_DELTA
from veil.accounting.tuning import TrialCount, trial_rdp
from veil.config import make_config
from veil.data import SCHEMA_CLASSES_FIX
from veil.errors import ConfigError, InvalidParameterError
from veil.pipeline.budget import plan_steps
from veil.pipeline.data import check_declarations, check_delta
from veil.pipeline.private_data import record_mask
from veil.pipeline.run_folder import check_out, default_out
from veil.presets import apply_presets, preset_for
from veil.tune.budget import ORDERS, BudgetSplit, split_budget
from veil.tune.charge import TuneCharge
from veil.tune.plan import TrialPlan, choose_plan
from veil.tune.space import PRESET_SHARE, Candidate, SearchSpace, around_preset
from veil.tune.trial import prepare_trial, run_reference, run_trial, score_event, trial_config
from veil.tune.units import records_outside

if TYPE_CHECKING:
    from veil.data import Dataset
    from veil.pipeline.data import Prepared

__all__ = ["TUNED_ON", "planned_size", "preset_candidate", "tune", "validation_mask"]

# Built-in benchmarks whose preset was tuned on them (veil.presets): tuning them with the default space
# is refused before reading unless asked for (docs/tune.md has the measurements).
TUNED_ON = ("digits", "fashion-mnist", "mnist", "breast-cancer")


def validation_mask(data: Dataset, fraction: float, seed: int) -> np.ndarray:
    """Which rows of the training split are held out for scoring (``fraction`` 0: none, every trial
    trains on the whole split and is scored on those rows, :func:`veil.tune.trial.run_trial`): a row
    is when the keyed hash of its own features and label
    (:func:`veil.pipeline.private_data.record_mask`, its own key domain, key from the public
    ``seed``) falls below ``fraction``; with a privacy unit, the keyed hash of the
    row's unit, so every row of a person lands on one side.

    Guarantee. A row's side depends on that row alone, never on its position or on how many rows there
    are: adding or removing one record of the training split adds or removes it from exactly one part,
    so add/remove neighbours stay add/remove neighbours on the training part (a random subset of fixed
    size would turn them into replace-one neighbours). The part's size varies like a binomial."""
    if not (0 <= fraction < 1):
        raise InvalidParameterError(
            "validation_fraction",
            fraction,
            "the validation split must leave data to train on",
            "pass a share in [0, 1): 0 scores on the training rows, e.g. 0.2 holds a fifth out",
        )
    if fraction == 0:
        return np.zeros(len(data.y_train), dtype=bool)
    labels = [str(data.classes[int(v)]) for v in np.asarray(data.y_train)]
    return record_mask(data.x_train, labels, fraction, "veil.tune.validation", seed, units=data.units_train)


def planned_size(n_public: int, fraction: float) -> int:
    """The public size of the training part every trial is planned on: ⌊(1 − F)·N⌋ with the validation
    share F (N itself when no row is held out), from the public N (DP-SGD's convention) and F alone.

    Guarantee. The part's exact size is a function of every record's side of the keyed split (one
    record moves it by one between same-N neighbours), so it is never a planning input: each trial
    samples every record of its part by Poisson at q = B / planned_size, a rate fixed before any row
    is read, whose amplification holds whatever the part's real size (even 0); q, the steps per
    epoch, σ and the checks on B and δ are then public functions of (N, F, B)."""
    return n_public if fraction == 0 else math.floor((1.0 - fraction) * n_public)


def _shapes(
    base: dict[str, Any], space: SearchSpace, mask: np.ndarray, epsilon: float, n_plan: int
) -> tuple[list[Any], list[tuple[int, int, float, int]]]:
    """The preprocessing events of every model in the space (all charged: an upper bound), then
    every shape's (epochs, batch, q, steps) on the public planned size of the training part."""
    prefix: list[Any] = []
    for model in space.model:
        cfg = make_config({**base, "model": model, "epsilon": epsilon, "noise_multiplier": 1.0})
        for e in prepare_trial(cfg, mask, n_plan)[0].pre_events:
            if e not in prefix:
                prefix.append(e)
    shapes = []
    for epochs, batch in space.budget_shapes:
        cfg = make_config({**base, "epochs": epochs, "batch_size": batch, "noise_multiplier": 1.0})
        steps = plan_steps(cfg, n_plan, prefix)
        shapes.append((epochs, batch, steps.q, steps.steps_planned))
    return prefix, shapes


def preset_candidate(full: Prepared, base: dict[str, Any], epsilon: float, n_plan: int) -> Candidate:
    """``veil train``'s defaults for this data (:mod:`veil.presets`: its kind and shape, and N for a
    table's batch) sized for the public planned size of the training part (:func:`planned_size`): a
    public choice, read from no private value."""
    cfg = make_config({**base, "epsilon": epsilon})
    cfg = apply_presets(cfg, preset_for(cfg.model, full.data), n_plan)
    assert cfg.lr is not None and cfg.epochs is not None and cfg.batch_size is not None
    assert cfg.max_grad_norm is not None
    return Candidate(
        float(cfg.lr), int(cfg.epochs), int(cfg.batch_size), float(cfg.max_grad_norm), full.model_name
    )


def refuse_benchmark_preset(dataset: str, epsilon: float) -> None:
    """Before a row is read: a built-in benchmark whose preset was tuned on it, with the default search
    space, is not worth tuning (docs/tune.md measured it): say so instead of spending the budget."""
    if dataset in TUNED_ON:
        raise ConfigError(
            "dataset",
            dataset,
            "veil train's preset for this benchmark was tuned on it; a private search pays more noise "
            "per trial and holds out a validation share, so it is not expected to beat the preset "
            "(docs/tune.md)",
            f"run `veil train --dataset {dataset} --epsilon {epsilon:g}`, give a search space "
            "(--lr, --epochs, ...), or pass --tune-anyway",
        )


def tune(
    *,
    dataset: str = "digits",
    dataset_id: str | None = None,
    epsilon: float = 3.0,
    delta: float = DEFAULT_DELTA,
    out: str | Path | None = None,
    space: SearchSpace | None = None,
    dims: dict[str, tuple[Any, ...]] | None = None,
    trials_mean: float | str = "auto",
    trials_law: str = "negative_binomial",
    trials_shape: float = 0.5,
    score_noise: float | str = "auto",
    validation_fraction: float = 0.0,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    preset_share: float = PRESET_SHARE,
    compare_preset: bool = True,
    tune_anyway: bool = False,
) -> dict[str, Any]:
    """Run ``veil tune`` and return the report (also written as ``report.json``); see the module
    docstring for the guarantee. ``dataset_id``: the declared identity the run is charged to (default:
    the data's fingerprint). ``validation_fraction``: the share held out for scoring (0, the default:
    none, each trial is scored on the rows it trained on). ``space``: the whole search space, or
    ``dims``: some of its lists, the others around the preset (:func:`veil.tune.space.around_preset`);
    either way the preset is drawn with probability ``preset_share``. ``trials_mean`` /
    ``score_noise`` ``"auto"``: chosen from public settings (:mod:`veil.tune.plan`).
    ``compare_preset``: also train ``veil train``'s preset on the whole training split for the
    non-private comparison. ``tune_anyway``: tune a built-in benchmark with the default space (refused
    otherwise, before reading). ``extra``: further train
    settings shared by every trial."""
    from veil.tune.report import write_report

    t0 = time.monotonic()
    count = None if trials_mean == "auto" else TrialCount(float(trials_mean), trials_law, trials_shape)  # type: ignore[arg-type]
    noise = None if score_noise == "auto" else float(score_noise)
    base: dict[str, Any] = {
        "dataset": dataset,
        **({"dataset_id": dataset_id} if dataset_id is not None else {}),
        "delta": delta,
        "seed": seed,
        "secure_rng": True,
        **(extra or {}),
    }
    # typos and wrong types, then the data's declarations (a label set, a schema), refused for free
    check_declarations(make_config({**base, "epsilon": epsilon}), SCHEMA_CLASSES_FIX)
    if space is None and not dims and not tune_anyway:
        refuse_benchmark_preset(dataset, epsilon)
    out_dir = Path(out if out is not None else default_out(dataset, job="tune"))
    check_out(out_dir)
    account = TuneCharge(dataset, base)  # an exhausted dataset is refused before a row is read
    account.reserve_before_reading(epsilon, delta)  # reading is charged, whatever follows
    try:
        full, _, _ = prepare_trial(make_config({**base, "epsilon": epsilon}), None)
        mask = validation_mask(full.data, validation_fraction, seed)
        n_train = records_outside(mask, full.data.units_train)  # exact: internal only (non_private)
        n_public = full.data.n_records  # N, public under DP-SGD's convention (as for every plan)
        n_plan = planned_size(n_public, validation_fraction)  # what every trial is planned on
        if n_plan < 1:  # public N and F: the same outcome whichever side each record fell on
            raise InvalidParameterError(
                "validation_fraction",
                validation_fraction,
                f"the planned training size ⌊(1 − F)·N⌋ with N = {n_public} is 0: nothing to train on",
                "lower --validation-fraction, or provide more examples",
            )
        preset = preset_candidate(full, base, epsilon, n_plan)
        if space is None:
            space = around_preset(preset, dims, preset_share)
        elif preset_share > 0 and space.preset is None:
            space = dataclasses.replace(space, preset=preset, preset_share=preset_share)
        ref = plan_steps(full.cfg, n_public, full.pre_events)
        split, plan = _admit(
            base,
            space,
            mask,
            epsilon,
            (count, noise),
            n_plan,
            (preset, ref.sigma, (validation_fraction or 1.0) * n_public),  # the rows scored
        )
        account.reserve(split.event(), delta)  # the whole procedure, before any trial or file
    except BaseException:
        account.abandon()  # settled at the stand-in (or the plan): never released after reading
        raise

    k = split.count.sample()
    account.start(out_dir)
    scoring = (mask, validation_fraction == 0, plan.n_validation)
    trials = _run_trials(k, base, space, split, scoring, plan.score_noise, out_dir, n_plan)
    chosen = max(trials, key=lambda t: t["noisy_score"]) if trials else None
    if chosen is not None:
        shutil.copyfile(out_dir / "trials" / str(chosen["trial"]) / "model.pt", out_dir / "model.pt")
    reference = None
    if compare_preset:
        ref_cfg = {**base, "epsilon": epsilon, "baseline": False, "progress": False, "audit": False}
        reference = run_reference(
            make_config({**ref_cfg, "out": str(out_dir / "reference")}), out_dir / "reference"
        )
    report = write_report(
        out_dir,
        dataset=full.data.name,
        n_train=n_train,
        n_validation=records_outside(~mask, full.data.units_train) if validation_fraction else 0,
        n_records=n_public,
        validation_fraction=validation_fraction,
        n_test=full.data.n_test,
        split=split,
        plan=plan,
        space=space,
        trials=trials,
        chosen=chosen,
        reference=reference,
        target=epsilon,
        duration=time.monotonic() - t0,
        privacy_unit=full.data.unit_column,
    )
    account.settle()
    return report


def _admit(
    base: dict[str, Any],
    space: SearchSpace,
    mask: np.ndarray,
    epsilon: float,
    given: tuple[TrialCount | None, float | None],
    n_plan: int,
    public: tuple[Candidate, float, float],
) -> tuple[BudgetSplit, TrialPlan]:
    """δ < 1/N and B ≤ N on the planned training size ``n_plan`` (:func:`planned_size`: public, so
    neither check depends on a record's side of the split), then the trial plan (given, or chosen
    from public settings: the preset, the σ of ``veil train`` with it, the expected validation size)
    and the budget split of the whole procedure (refused here, before any trial, if it cannot fit)."""
    check_delta(base["delta"], n_plan)
    for b in space.batch_size:
        if b > n_plan:
            raise ConfigError(
                "batch_size",
                b,
                f"the sampling rate B/n must be ≤ 1 on the planned training size n = ⌊(1 − F)·N⌋ = {n_plan}",
                f"lower it to at most {n_plan}",
            )
    preset, ref_sigma, n_validation = public
    prefix, shapes = _shapes(base, space, mask, epsilon, n_plan)
    preset_shape = (
        next(s for s in shapes if s[:2] == (preset.epochs, preset.batch_size))
        if ((preset.epochs, preset.batch_size) in [s[:2] for s in shapes])
        else shapes[-1]
    )
    count, noise = given
    if count is None or noise is None:
        auto = choose_plan(
            epsilon, base["delta"], preset_shape, prefix, max(1, round(n_validation)), ref_sigma
        )
        count, noise = count or auto.count, noise if noise is not None else auto.score_noise
    split = split_budget(epsilon, base["delta"], count, shapes, prefix, score_event(noise))
    auto_or_given = "auto" if given == (None, None) else ("given" if None not in given else "partly auto")
    plan = TrialPlan(
        count, noise, ref_sigma, split.shape(*preset_shape[:2]).sigma, auto_or_given, n_validation
    )
    return split, plan


def _run_trials(
    k: int,
    base: dict[str, Any],
    space: SearchSpace,
    split: BudgetSplit,
    scoring: tuple[np.ndarray, bool, float],
    score_noise: float,
    out_dir: Path,
    n_plan: int | None = None,
) -> list[dict[str, Any]]:
    """``k`` trials, each a candidate drawn from the space and trained at its shape's σ; each records
    whether its spent RDP curve stayed under the planned one. ``scoring``: the validation mask,
    whether the score is on the training rows instead (no row held out), and the public number the
    noisy count is divided by (the expected number of scored records, F·N or N). ``n_plan``: the
    public size each trial's steps are planned on (:func:`planned_size`)."""
    mask, on_training, score_over = scoring
    trials: list[dict[str, Any]] = []
    planned = split.trial_curve()
    for i in range(k):
        cand = space.draw()
        shape = split.shape(cand.epochs, cand.batch_size)
        own = split.trial_epsilon(shape.events(split.prefix, split.score_event))
        cfg = trial_config(base, cand, shape, own * 1.05 + 0.01, out_dir / "trials" / str(i + 1))
        folder = out_dir / "trials" / str(i + 1)
        result = run_trial(cfg, mask, shape, score_noise, folder, on_training, score_over, n_plan)
        spent = trial_rdp(result.pop("events"), ORDERS)
        result["within_plan"] = bool(np.all(spent <= planned + 1e-12))
        trials.append({"trial": i + 1, **cand.to_dict(), **result})
    return trials
