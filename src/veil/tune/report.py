"""The ``veil tune`` report: ``report.json`` and ``report.html`` (through the shared page stack).

What is private (covered by the tuning guarantee) and what is not is kept apart: the chosen
candidate and its noisy score sit at the top; K, every trial and every test accuracy are in the
``non_private`` section (the top-level ``trials`` and ``test_accuracy`` repeat two of its figures
for scripts, and are listed in ``non_private_fields``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from veil.pipeline.outputs import finite
from veil.pipeline.run_folder import write_files
from veil.report import Check
from veil.tune.budget import BudgetSplit
from veil.tune.space import SearchSpace

__all__ = ["write_report"]

GUARANTEE = (
    "The chosen model (model.pt), its hyperparameters and its noisy validation score are (ε = {eps:.4g}, "
    "δ = {delta:g})-differentially private for the training data (training and validation parts "
    "together), under add/remove-one neighbouring: the whole tuning procedure is accounted (Papernot & "
    "Steinke 2022, a {law} number of trials with mean {mean:g}), not the best trial alone."
)
CAVEATS = [
    "Not covered: the number of trials, the other trials (under trials/) and every test accuracy. "
    "They are shown below as non-private diagnostics; releasing them voids the bound. Release only "
    "model.pt and the private part of this report.",
    "The number of trials was drawn from the stated law with the OS CSPRNG and never capped or cut "
    "short on a good score: the bound depends on it.",
]
FILES = {
    "report.json": "this report, machine-readable",
    "report.html": "this report as a page",
    "model.pt": "the chosen DP model's state_dict (torch.load(path, weights_only=True))",
    "trials/": "every trial's run folder and ledger (internal: not covered by the guarantee)",
}


def _checks(split: BudgetSplit, target: float, trials: list[dict[str, Any]]) -> list[Check]:
    return [
        Check(
            name="Total ε within target",
            passed=split.epsilon <= target,
            detail=f"random-stopping bound {split.epsilon:.4f} ≤ target {target:g} at δ = {split.delta:g}",
        ),
        Check(
            name="Every trial within its planned share",
            passed=all(t["within_plan"] for t in trials),
            detail="each trial's ledger, as an RDP curve, is at most the planned per-trial curve",
        ),
    ]


def _budget(split: BudgetSplit, score_noise: float) -> dict[str, Any]:
    return {
        "orders": "integer 2..64, 80, 96, 128, 192, 256",
        "trial_count": {"law": split.count.law, "mean": split.count.mean, "shape": split.count.shape},
        "score_noise_std": score_noise,
        "epsilon_score_alone": split.trial_epsilon([split.score_event]),
        "epsilon_preprocessing_alone": split.trial_epsilon(split.prefix) if split.prefix else 0.0,
        "shapes": [
            {
                "epochs": s.epochs,
                "batch_size": s.batch_size,
                "sampling_rate": s.q,
                "steps": s.steps,
                "noise_multiplier": s.sigma,
                "epsilon_training_alone": split.trial_epsilon(s.events([], split.score_event)[:-1]),
                "epsilon_one_trial": split.trial_epsilon(s.events(split.prefix, split.score_event)),
            }
            for s in split.shapes
        ],
        "epsilon_total": split.epsilon,
        "event": split.event().to_dict(),  # what the budget registry is charged with
    }


def write_report(
    out: Path,
    *,
    dataset: str,
    n_train: int,
    n_validation: int,
    n_test: int,
    split: BudgetSplit,
    space: SearchSpace,
    trials: list[dict[str, Any]],
    chosen: dict[str, Any] | None,
    score_noise: float,
    target: float,
    duration: float,
    privacy_unit: str | None = None,
) -> dict[str, Any]:
    """Write ``report.json`` and ``report.html`` to ``out``; return the report.

    ``privacy_unit``: the unit column every trial and the score protect (``n_train`` and
    ``n_validation`` then count units); None: rows."""
    import veil
    from veil.report.render import render_page

    keys = ("lr", "epochs", "batch_size", "max_grad_norm", "model")
    report: dict[str, Any] = {
        "job": "tune",
        "veil_version": veil.__version__,
        "dataset": dataset,
        "n_train": n_train,
        "n_validation": n_validation,
        "privacy_unit": privacy_unit,
        "epsilon": split.epsilon,
        "target_epsilon": target,
        "delta": split.delta,
        "accountant": "rdp (random-stopping tuning, Papernot & Steinke 2022)",
        "neighbouring": "add_or_remove_one",
        "chosen": None
        if chosen is None
        else {
            **{k: chosen[k] for k in keys},
            "noise_multiplier": chosen["sigma"],
            "steps": chosen["steps"],
            "noisy_validation_accuracy": chosen["noisy_score"],
        },
        "budget_split": _budget(split, score_noise),
        "search_space": space.to_dict(),
        "trials": len(trials),
        "test_accuracy": None if chosen is None else chosen["test_accuracy"],
        "non_private_fields": ["trials", "test_accuracy"],
        "non_private": {
            "note": CAVEATS[0],
            "trials_run": len(trials),
            "n_test": n_test,
            "test_accuracy": None if chosen is None else chosen["test_accuracy"],
            "trials": trials,
        },
        "checks": [c.model_dump() for c in _checks(split, target, trials)],
        "files": FILES if chosen is not None else {k: v for k, v in FILES.items() if k != "model.pt"},
        "out_dir": str(out),
        "duration_s": duration,
    }
    report = finite(report)
    law = "truncated negative binomial" if split.count.law == "negative_binomial" else "Poisson"
    page = render_page(
        "tune.html.j2",
        {},
        r=report,
        guarantee=GUARANTEE.format(eps=split.epsilon, delta=split.delta, law=law, mean=split.count.mean),
        caveats=CAVEATS[1:],
        checks=report["checks"],
        files=report["files"],
    )
    import json

    write_files(out, {"report.html": page, "report.json": json.dumps(report, indent=2)})
    return report
