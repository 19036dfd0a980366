"""``veil tune`` as a function: private hyperparameter tuning by random stopping.

Flow: config → the full training split cut once into (training, validation) by a keyed hash of each
record (:func:`validation_mask`) → the trial shapes' σ from the budget split (:mod:`veil.tune.budget`) →
K drawn from the trial-count law (OS CSPRNG) → K trials, each a full DP training run through the train
job's loop with its own ledger, then its noisy validation count → the candidate with the best noisy
score is released (``model.pt``) → ``report.json`` and ``report.html``.

Guarantee. The chosen model, its hyperparameters and its noisy validation score are (ε, δ)-DP for
the training split (training and validation parts together) under add/remove-one neighbouring (of a
unit with all its rows with ``privacy_unit``: :mod:`veil.tune.units`), where
ε is the random-stopping bound of :mod:`veil.accounting.tuning` over the largest RDP curve of any
trial the space allows (preprocessing, every DP-SGD step, the score), never the best trial's own ε.
Not covered, and labelled ``non_private`` in the report: the number of trials K, the other trials
(their hyperparameters, scores and models under ``trials/``) and every test accuracy. Releasing K
or the other trials voids the bound; only the chosen model is meant for release.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.defaults import DEFAULT_DELTA
from veil.accounting.tuning import TrialCount, trial_rdp
from veil.config import make_config
from veil.errors import ConfigError, InvalidParameterError
from veil.pipeline.budget import plan_steps
from veil.pipeline.data import check_delta
from veil.pipeline.private_data import record_mask
from veil.pipeline.run_folder import check_out, default_out
from veil.tune.budget import ORDERS, BudgetSplit, split_budget
from veil.tune.charge import TuneCharge
from veil.tune.space import SearchSpace
from veil.tune.trial import prepare_trial, run_trial, score_event, trial_config
from veil.tune.units import records_outside

if TYPE_CHECKING:
    from veil.data import Dataset

__all__ = ["tune", "validation_mask"]


def validation_mask(data: Dataset, fraction: float, seed: int) -> np.ndarray:
    """Which rows of the training split are held out for scoring: a row is when the keyed hash of its
    own features and label (:func:`veil.pipeline.private_data.record_mask`, its own key domain, key
    from the public ``seed``) falls below ``fraction``; with a privacy unit, the keyed hash of the
    row's unit, so every row of a person lands on one side.

    Guarantee. A row's side depends on that row alone, never on its position or on how many rows there
    are: adding or removing one record of the training split adds or removes it from exactly one part,
    so add/remove neighbours stay add/remove neighbours on the training part (a random subset of fixed
    size would turn them into replace-one neighbours). The part's size varies like a binomial."""
    if not (0 < fraction < 1):
        raise InvalidParameterError(
            "validation_fraction",
            fraction,
            "the validation split must leave data to train on and score",
            "pass a share in (0, 1), e.g. 0.2",
        )
    labels = [str(data.classes[int(v)]) for v in np.asarray(data.y_train)]
    return record_mask(data.x_train, labels, fraction, "veil.tune.validation", seed, units=data.units_train)


def _plan(
    base: dict[str, Any],
    space: SearchSpace,
    mask: np.ndarray,
    epsilon: float,
    count: TrialCount,
    score_noise: float,
    n_train: int,
) -> BudgetSplit:
    """Every shape's (q, steps) on the reduced training split, the preprocessing events of every model
    in the space (all charged: an upper bound), then the σ split."""
    prefix: list[Any] = []
    for model in space.model:
        cfg = make_config({**base, "model": model, "epsilon": epsilon, "noise_multiplier": 1.0})
        for e in prepare_trial(cfg, mask)[0].pre_events:
            if e not in prefix:
                prefix.append(e)
    shapes = []
    for epochs, batch in space.budget_shapes:
        cfg = make_config({**base, "epochs": epochs, "batch_size": batch, "noise_multiplier": 1.0})
        steps = plan_steps(cfg, n_train, prefix)
        shapes.append((epochs, batch, steps.q, steps.steps_planned))
    return split_budget(epsilon, base["delta"], count, shapes, prefix, score_event(score_noise))


def tune(
    *,
    dataset: str = "digits",
    dataset_id: str | None = None,
    epsilon: float = 3.0,
    delta: float = DEFAULT_DELTA,
    out: str | Path | None = None,
    space: SearchSpace | None = None,
    trials_mean: float = 3.0,
    trials_law: str = "negative_binomial",
    trials_shape: float = 0.5,
    score_noise: float = 5.0,
    validation_fraction: float = 0.2,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``veil tune`` and return the report (also written as ``report.json``); see the module
    docstring for the guarantee. ``dataset_id``: the declared identity the run is charged to (default:
    the data's fingerprint). ``extra``: further train settings shared by every trial."""
    from veil.tune.report import write_report

    t0 = time.monotonic()
    space = space or SearchSpace()
    count = TrialCount(trials_mean, trials_law, trials_shape)  # type: ignore[arg-type]
    base: dict[str, Any] = {
        "dataset": dataset,
        **({"dataset_id": dataset_id} if dataset_id is not None else {}),
        "delta": delta,
        "seed": seed,
        "secure_rng": True,
        **(extra or {}),
    }
    make_config({**base, "epsilon": epsilon})  # typos and wrong types refused before anything else
    out_dir = Path(out if out is not None else default_out(dataset, job="tune"))
    check_out(out_dir)
    account = TuneCharge(dataset, base)  # an exhausted dataset is refused before a row is read
    account.reserve_before_reading(epsilon, delta)  # reading is charged, whatever follows
    try:
        full, _, _ = prepare_trial(make_config({**base, "epsilon": epsilon}), None)
        mask = validation_mask(full.data, validation_fraction, seed)
        n_train = records_outside(mask, full.data.units_train)  # rows, or units with a privacy unit
        split = _admit(base, space, mask, epsilon, count, score_noise, n_train)
        account.reserve(split.event(), delta)  # the whole procedure, before any trial or file
    except BaseException:
        account.abandon()  # settled at the stand-in (or the plan): never released after reading
        raise

    k = count.sample()
    account.start(out_dir)
    trials = _run_trials(k, base, space, split, mask, score_noise, out_dir)
    chosen = max(trials, key=lambda t: t["noisy_score"]) if trials else None
    if chosen is not None:
        shutil.copyfile(out_dir / "trials" / str(chosen["trial"]) / "model.pt", out_dir / "model.pt")
    report = write_report(
        out_dir,
        dataset=full.data.name,
        n_train=n_train,
        n_validation=records_outside(~mask, full.data.units_train),
        n_test=full.data.n_test,
        split=split,
        space=space,
        trials=trials,
        chosen=chosen,
        score_noise=score_noise,
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
    count: TrialCount,
    score_noise: float,
    n_train: int,
) -> BudgetSplit:
    """δ < 1/N and B ≤ N on the training part, then the budget split of the whole procedure (refused
    here, before any trial, if it cannot fit)."""
    check_delta(base["delta"], n_train)
    for b in space.batch_size:
        if b > n_train:
            raise ConfigError("batch_size", b, "the sampling rate B/N must be ≤ 1", "lower it")
    return _plan(base, space, mask, epsilon, count, score_noise, n_train)


def _run_trials(
    k: int,
    base: dict[str, Any],
    space: SearchSpace,
    split: BudgetSplit,
    mask: np.ndarray,
    score_noise: float,
    out_dir: Path,
) -> list[dict[str, Any]]:
    """``k`` trials, each a candidate drawn from the space and trained at its shape's σ; each records
    whether its spent RDP curve stayed under the planned one."""
    trials: list[dict[str, Any]] = []
    planned = split.trial_curve()
    for i in range(k):
        cand = space.draw()
        shape = split.shape(cand.epochs, cand.batch_size)
        own = split.trial_epsilon(shape.events(split.prefix, split.score_event))
        cfg = trial_config(base, cand, shape, own * 1.05 + 0.01, out_dir / "trials" / str(i + 1))
        result = run_trial(cfg, mask, shape, score_noise, out_dir / "trials" / str(i + 1))
        spent = trial_rdp(result.pop("events"), ORDERS)
        result["within_plan"] = bool(np.all(spent <= planned + 1e-12))
        trials.append({"trial": i + 1, **cand.to_dict(), **result})
    return trials
