"""The ``veil tune`` report: ``report.json`` and ``report.html`` (through the shared page stack).

What is private (covered by the tuning guarantee) and what is not is kept apart, in the common
report schema (:mod:`veil.report.schema`): the chosen candidate and its noisy score are released in
the ``tune`` section (the tuning ledger's event behind them); the number of trials K (releasing it
voids the tuning bound), every trial and every test accuracy are only in ``non_private``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from veil.pipeline.run_folder import write_files
from veil.report import Check
from veil.tune.budget import BudgetSplit
from veil.tune.plan import TrialPlan
from veil.tune.space import SearchSpace

__all__ = ["write_report"]

GUARANTEE = (
    "The chosen model (model.pt), its hyperparameters and its noisy score are (ε = {eps:.4g}, "
    "δ = {delta:g})-differentially private for the training split ({parts}), {who}: the whole tuning "
    "procedure is accounted (Papernot & Steinke 2022, a {law} number of trials with mean {mean:g}), "
    "not the best trial alone."
)
CAVEATS = [
    "Not covered: the number of trials, the other trials (under trials/), the preset's reference run "
    "(under reference/, trained on the private data and not released) and every test accuracy. "
    "They are shown below as non-private diagnostics; releasing them voids the bound. Release only "
    "model.pt and the private part of this report.",
    "The number of trials was drawn from the stated law with the OS CSPRNG and never capped or cut "
    "short on a good score: the bound depends on it.",
]
FILES = {
    "report.json": "this report, machine-readable (the full internal one)",
    "report.html": "this report as a page (the full internal one)",
    "model.pt": "the chosen DP model's state_dict (torch.load(path, weights_only=True))",
    "trials/": "INTERNAL, non-private: every trial's run folder and ledger (their number is K)",
    "reference/": "INTERNAL, non-private: veil train's preset on the whole training split, for the "
    "comparison (its model deleted)",
    "ledger.jsonl": "the tuning ledger: the one charged event",
    "release": "what the guarantee covers, publishable as is: the chosen model and the public report",
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


def _budget(split: BudgetSplit, plan: TrialPlan) -> dict[str, Any]:
    return {
        "orders": "integer 2..64, 80, 96, 128, 192, 256",
        "trial_count": {"law": split.count.law, "mean": split.count.mean, "shape": split.count.shape},
        "score_noise_std": plan.score_noise,
        "plan": plan.to_dict(),  # public: chosen from public settings only (veil.tune.plan)
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
    plan: TrialPlan,
    space: SearchSpace,
    trials: list[dict[str, Any]],
    chosen: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    target: float,
    duration: float,
    privacy_unit: str | None = None,
    n_records: int | None = None,
    validation_fraction: float = 0.0,
) -> dict[str, Any]:
    """Write ``report.json`` and ``report.html`` to ``out``; return the report.

    ``privacy_unit``: the unit column every trial and the score protect (``n_records``, ``n_train``
    and ``n_validation`` then count units); None: rows. ``n_validation`` 0: no row held out, each
    trial scored on the rows it trained on.

    Public: ``n_records`` (N, the training split's size, public under DP-SGD's convention as in every
    plan), ``validation_fraction`` F and ``score_over`` (F·N, or N without a hold-out: the public
    number the noisy score is divided by). The exact ``n_train`` and ``n_validation`` are only in
    ``non_private``: a record's side of the split is a keyed hash with a public key, so the exact count
    of either part tells whether the one record that differs between neighbours fell on that side.
    ``reference``: ``veil train``'s preset run on the whole training split
    (:func:`veil.tune.trial.run_reference`), compared in ``non_private`` only."""
    import veil
    from veil.report.publish import publish
    from veil.report.render import render_page

    keys = ("lr", "epochs", "batch_size", "max_grad_norm", "model")
    report = _envelope(
        out,
        split,
        {
            "veil_version": veil.__version__,
            "dataset": dataset,
            "n_records": n_train + n_validation if n_records is None else n_records,
            "validation_fraction": validation_fraction,
            "score_over": plan.n_validation,
            "score_rows": (
                "held-out validation part" if validation_fraction else "the training rows (no hold-out)"
            ),
            "epsilon": split.epsilon,
            "target_epsilon": target,
            "delta": split.delta,
            "accountant": "rdp (random-stopping tuning, Papernot & Steinke 2022)",
            "privacy_unit": privacy_unit,
            "neighbouring": "add_or_remove_one" if privacy_unit is None else "add_or_remove_one_unit",
            "budget_split": _budget(split, plan),
            "search_space": space.to_dict(),
            "out_dir": str(out),
        },
        None
        if chosen is None
        else {
            **{k: chosen[k] for k in keys},
            "noise_multiplier": chosen["sigma"],
            "steps": chosen["steps"],
            "noisy_validation_accuracy": chosen["noisy_score"],
        },
        {
            "n_train": n_train,  # exact: which side each record fell on (see the docstring)
            "n_validation": n_validation,
            "trials_run": len(trials),
            "duration_s": duration,  # grows with the number of trials K: releasing it voids the bound
            "n_test": n_test,
            "test_accuracy": None if chosen is None else chosen["test_accuracy"],
            "trials": trials,
            **_comparison(chosen, reference, n_test),
        },
        _checks(split, target, trials),
    )
    page = render_page(
        "tune.html.j2",
        {},
        r=report,
        guarantee=report["guarantee"]["statement"],
        caveats=CAVEATS[1:],
        checks=report["checks"],
        files=report["files"],
        summary=report["summary"],
        dataset_budget=report["dataset_budget"],
    )
    import json

    write_files(out, {"report.html": page, "report.json": json.dumps(report, indent=2)})
    model = out / "model.pt"
    publish(out, report, {"model.pt": model.read_bytes()} if model.is_file() else {})
    return report


def _comparison(
    chosen: dict[str, Any] | None, reference: dict[str, Any] | None, n_test: int
) -> dict[str, Any]:
    """The non-private comparison of the chosen model with ``veil train``'s preset (test accuracies),
    and the recommendation it supports (:func:`verdict`)."""
    if reference is None:
        return {"preset_reference": None, "chosen_minus_preset": None, "recommendation": None}
    acc = None if chosen is None else chosen["test_accuracy"]
    ref = reference["test_accuracy"]
    diff = None if acc is None or ref is None else acc - ref
    return {
        "preset_reference": reference,
        "chosen_minus_preset": diff,
        "recommendation": None if diff is None else verdict(diff, ref, n_test),
    }


def verdict(diff: float, preset_accuracy: float, n_test: int) -> str:
    """One sentence for the operator (non-private: it reads test accuracies): did tuning pay here?

    The test split's resolution is the binomial standard error of the preset's accuracy on ``n_test``
    rows; a difference within twice it is called a tie. It advises on the next run on this data and
    chooses nothing: the released model is the tuned one either way (choosing by test accuracy would be
    selection on the test set, and the preset's reference model is not covered and deleted)."""
    se = (max(preset_accuracy * (1 - preset_accuracy), 1.0 / max(n_test, 1)) / max(n_test, 1)) ** 0.5
    points, band = 100 * diff, 200 * se
    where = f"{points:+.1f} points against veil train's preset on the {n_test} test rows"
    if diff <= 0 and -points > band:
        return (
            f"Tuning did not pay here ({where}, beyond the test split's ±{band:.1f}): prefer "
            "`veil train` with its defaults on this data."
        )
    if abs(points) <= band:
        return (
            f"Tuning did not clearly pay ({where}, within the test split's ±{band:.1f}): its price "
            "bought no measurable gain; `veil train` with its defaults costs less time for the same ε."
        )
    return f"Tuning paid here ({where}, beyond the test split's ±{band:.1f})."


def _who(settings: dict[str, Any]) -> str:
    """Whom the statement protects: each person with a privacy unit; else each row, said plainly."""
    unit = settings.get("privacy_unit")
    if unit is None:
        return (
            "under add/remove-one neighbouring (each row on its own: a person with several rows is "
            "protected only by group privacy, which is weaker; name a --privacy-unit column to protect "
            "people)"
        )
    return (
        f"for each person (unit column `{unit}`), whatever number of rows they have (add/remove one "
        "unit with all its rows)"
    )


def _envelope(
    out: Path,
    split: BudgetSplit,
    settings: dict[str, Any],
    chosen: dict[str, Any] | None,
    non_private: dict[str, Any],
    checks: list[Check],
) -> dict[str, Any]:
    """The report in the common schema: the chosen candidate released on the tuning event."""
    from veil.accounting.ledger import Ledger
    from veil.pipeline.run_folder import LEDGER
    from veil.registry.charge import budget_section_for
    from veil.report.publish import plain_summary
    from veil.report.schema import Evidence, Guarantee, ReportBuilder

    ledger = Ledger.open(out / LEDGER)
    events = ledger.events()
    evidence = Evidence.of(LEDGER, events)
    law = "truncated negative binomial" if split.count.law == "negative_binomial" else "Poisson"
    passed = all(c.passed for c in checks)
    guarantee = Guarantee(
        epsilon=split.epsilon,
        delta=split.delta,
        unit="row" if settings.get("privacy_unit") is None else "privacy unit",
        neighbouring=str(settings["neighbouring"]),
        accountant=str(settings["accountant"]),
        covers="the chosen model (model.pt), its hyperparameters and its noisy score; not the "
        "number of trials, the other trials or any test accuracy",
        randomness="secure",
        release_ready=passed and chosen is not None,
        statement=GUARANTEE.format(
            eps=split.epsilon,
            delta=split.delta,
            parts="training and validation parts together"
            if settings["validation_fraction"]
            else "every row",
            law=law,
            mean=split.count.mean,
            who=_who(settings),
        ),
        evidence=evidence,
        extra={"target_epsilon": settings["target_epsilon"]},
    )
    b = ReportBuilder("tune", guarantee).public_fields(settings)
    b.released("chosen", chosen, evidence)
    b.non_private_fields({"note": CAVEATS[0], **non_private})
    for name, what in FILES.items():
        if (name != "model.pt" or chosen is not None) and (
            name != "reference/" or non_private.get("preset_reference") is not None
        ):
            b.file(name, what, release=name == "model.pt")
    b.release_file("report.json").release_file("report.html").checks(checks)
    b.dataset_budget = budget_section_for(ledger.header.get("budget_run_id"), events, out)
    b.summary = plain_summary(guarantee.to_dict(), b.dataset_budget, "the chosen model")
    return b.build()
