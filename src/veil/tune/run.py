"""``veil tune`` as a function: private hyperparameter tuning by random stopping.

Flow: config → the full training split cut once into (training, validation) by a data-independent
secure draw → the trial shapes' σ from the budget split (:mod:`veil.tune.budget`) → K drawn from the
trial-count law (OS CSPRNG) → K trials, each a full DP training run through the train job's loop
with its own ledger, then its noisy validation count → the candidate with the best noisy score is
released (``model.pt``) → ``report.json`` and ``report.html``.

Guarantee. The chosen model, its hyperparameters and its noisy validation score are (ε, δ)-DP for
the training split (training and validation parts together) under add/remove-one neighbouring, where
ε is the random-stopping bound of :mod:`veil.accounting.tuning` over the largest RDP curve of any
trial the space allows (preprocessing, every DP-SGD step, the score), never the best trial's own ε.
Not covered, and labelled ``non_private`` in the report: the number of trials K, the other trials
(their hyperparameters, scores and models under ``trials/``) and every test accuracy. Releasing K
or the other trials voids the bound; only the chosen model is meant for release.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from veil.accounting.defaults import DEFAULT_DELTA
from veil.accounting.tuning import TrialCount, trial_rdp
from veil.config import make_config
from veil.errors import ConfigError, InvalidParameterError
from veil.pipeline.budget import plan_steps
from veil.pipeline.data import check_delta
from veil.pipeline.run_folder import check_out, default_out
from veil.tune.budget import ORDERS, BudgetSplit, split_budget
from veil.tune.charge import TuneCharge
from veil.tune.space import SearchSpace
from veil.tune.trial import prepare_trial, run_trial, score_event, trial_config

__all__ = ["tune"]


def _validation_mask(n: int, fraction: float) -> np.ndarray:
    """A held-out share of the training split, drawn from the OS CSPRNG (independent of the data)."""
    if not (0 < fraction < 1):
        raise InvalidParameterError(
            "validation_fraction",
            fraction,
            "the validation split must leave data to train on and score",
            "pass a share in (0, 1), e.g. 0.2",
        )
    n_val = max(1, round(fraction * n))
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(secrets.randbits(128)).permutation(n)[:n_val]] = True
    return mask


def _plan(
    base: dict[str, Any],
    space: SearchSpace,
    mask: np.ndarray,
    epsilon: float,
    count: TrialCount,
    score_noise: float,
) -> BudgetSplit:
    """Every shape's (q, steps) on the reduced training split, the preprocessing events of every model
    in the space (all charged: an upper bound), then the σ split."""
    prefix: list[Any] = []
    for model in space.model:
        cfg = make_config({**base, "model": model, "epsilon": epsilon, "noise_multiplier": 1.0})
        for e in prepare_trial(cfg, mask)[0].pre_events:
            if e not in prefix:
                prefix.append(e)
    n_train = int((~mask).sum())
    shapes = []
    for epochs, batch in space.budget_shapes:
        cfg = make_config({**base, "epochs": epochs, "batch_size": batch, "noise_multiplier": 1.0})
        steps = plan_steps(cfg, n_train, prefix)
        shapes.append((epochs, batch, steps.q, steps.steps_planned))
    return split_budget(epsilon, base["delta"], count, shapes, prefix, score_event(score_noise))


def tune(
    *,
    dataset: str = "digits",
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
    docstring for the guarantee. ``extra``: further train settings shared by every trial."""
    from veil.tune.report import write_report

    t0 = time.monotonic()
    space = space or SearchSpace()
    count = TrialCount(trials_mean, trials_law, trials_shape)  # type: ignore[arg-type]
    base: dict[str, Any] = {
        "dataset": dataset,
        "delta": delta,
        "seed": seed,
        "secure_rng": True,
        **(extra or {}),
    }
    make_config({**base, "epsilon": epsilon})  # typos and wrong types refused before anything else
    out_dir = Path(out if out is not None else default_out(dataset, job="tune"))
    check_out(out_dir)
    account = TuneCharge(dataset, base)  # an exhausted dataset is refused before a row is read
    full, _, _ = prepare_trial(make_config({**base, "epsilon": epsilon}), None)
    mask = _validation_mask(full.data.n_train, validation_fraction)
    check_delta(delta, int((~mask).sum()))
    for b in space.batch_size:
        if b > int((~mask).sum()):
            raise ConfigError("batch_size", b, "the sampling rate B/N must be ≤ 1", "lower it")
    split = _plan(base, space, mask, epsilon, count, score_noise)
    account.reserve(split.event(), delta)  # the whole procedure, before any trial or file

    k = count.sample()
    account.start(out_dir)
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
    chosen = max(trials, key=lambda t: t["noisy_score"]) if trials else None
    if chosen is not None:
        shutil.copyfile(out_dir / "trials" / str(chosen["trial"]) / "model.pt", out_dir / "model.pt")
    report = write_report(
        out_dir,
        dataset=full.data.name,
        n_train=int((~mask).sum()),
        n_validation=int(mask.sum()),
        n_test=full.data.n_test,
        split=split,
        space=space,
        trials=trials,
        chosen=chosen,
        score_noise=score_noise,
        target=epsilon,
        duration=time.monotonic() - t0,
    )
    account.settle()
    return report
