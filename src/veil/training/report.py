"""The train job's :class:`~veil.report.Report`: the run's figures, what the guarantee covers in
words, and the ``non_private`` section (test metrics, baseline, audit, labels for the fields that are
not released under the guarantee). Built after training from the plan, the ledger and the loop's
results; nothing here reads a private row."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.accounting.ledger import Ledger
from veil.distributed.runtime import rank_and_world
from veil.pipeline.checks import data_use_check
from veil.pipeline.loop import RunPlan
from veil.pipeline.randomness import RESEARCH_CAVEAT, randomness_of, release_ready
from veil.pipeline.run_folder import CHECKPOINTS, LEDGER
from veil.pipeline.units import unit_covers, unit_section
from veil.report import DatasetInfo, NonPrivate, Report
from veil.report.train_report import file_table
from veil.training.prepare import max_rows

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FILES", "build_report", "guarantee_covers"]

FILES = (
    "report.json",
    "report.html",
    "epsilon.png",
    "curves.png",
    "model.pt",
    "config.toml",
    LEDGER,
    CHECKPOINTS,
)


def build_report(plan: RunPlan, run_dir: Path, ledger: Ledger, model: nn.Module, **result: Any) -> Report:
    """The :class:`Report` of a finished run (``result``: ε, accuracies, history, checks, ...)."""
    import veil

    cfg, data, steps = plan.cfg, plan.data, plan.steps
    assert cfg.max_grad_norm is not None and cfg.batch_size is not None
    assert cfg.epochs is not None and cfg.lr is not None
    randomness = randomness_of(cfg.reproducible)
    units = unit_section(cfg, data, max_rows(plan))
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
        preprocessing=_preprocessing(plan),
        dataset=_dataset(plan),
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
        covers=guarantee_covers(plan, ledger),
        neighbouring="add_or_remove_one" if units is None else "add_or_remove_one_unit",
        privacy_unit=units,
        seed=cfg.seed,
        veil_version=veil.__version__,
        duration_s=result["duration"],
        resumes=sum(1 for _ in ledger.of_kind("resume")),
        world_size=rank_and_world()[1],
        checks=result["checks"],
        non_private=_non_private(plan, units is not None, result),
        files=file_table(_file_names(plan)),
        out_dir=str(run_dir),
        streaming=data.summary() if cfg.stream else None,  # type: ignore[attr-defined]
    )
    checks = [*result["checks"], data_use_check(plan.prepared, ledger, report.to_dict())]
    return report.model_copy(update={"checks": checks, "release_ready": release_ready(randomness, checks)})


def _file_names(plan: RunPlan) -> list[str]:
    """The files of the run folder the report lists (the DP preprocessing and a table's encoder if any)."""
    names = [*FILES, "release"]
    if not plan.prep.public:
        names.append("preprocessing.json")
    if plan.prepared.whitening is not None:
        from veil.pipeline.loop import WHITENING_FILE

        names.append(WHITENING_FILE)
    if plan.data.encoder is not None:
        names.append("encoder.json")
    return names


def _preprocessing(plan: RunPlan) -> dict[str, Any]:
    """The report's ``preprocessing`` section: the method, and its DP event unless it was public."""
    section: dict[str, Any] = {
        "method": plan.prep.method,
        "description": plan.prep.description,
        "public": plan.prep.public,
        "event": None if plan.prep.event is None else plan.prep.event.to_dict(),
    }
    w = plan.prepared.whitening
    if w is not None:
        section["whitening"] = {
            "description": (
                "the head's unit rows (norm ≤ 1) whitened by P = (max(G̃, 0)/n + λI)^(-1/2) from one "
                f"Gaussian release G̃ of their Gram matrix (noise std {w.std:g} per coordinate, "
                f"sensitivity 1; λ = {w.ridge:g}), before the steps; each row zP rescaled to norm "
                f"{w.row_norm:g}; model.pt carries P (post-processing of the release)"
            ),
            "event": w.event.to_dict(),
        }
    return section


def _dataset(plan: RunPlan) -> DatasetInfo:
    data = plan.data
    return DatasetInfo(
        name=data.name,
        n_train=data.n_train,
        n_test=data.n_test,
        sha256=data.sha256,
        kind=data.kind,
        num_classes=data.num_classes,
    )


def _non_private(plan: RunPlan, units: bool, result: dict[str, Any]) -> NonPrivate:
    """The report's one ``non_private`` section: what the guarantee does not cover."""
    baseline_acc, test_acc = result["baseline_acc"], result["test_acc"]
    return NonPrivate(
        test_accuracy=test_acc,
        baseline_test_accuracy=baseline_acc,
        baseline_stopped=result["baseline_stopped"],
        utility_drop=None if baseline_acc is None else baseline_acc - test_acc,
        history=result["history"],
        audit=result["audit"],
        per_record_rules={
            **plan.data.rules,
            # sampled examples (repeats counted) dropped for a non-finite gradient, on this process
            **(
                {"examples_dropped_gradient_not_finite": result["dropped_not_finite"]}
                if "dropped_not_finite" in result
                else {}
            ),
        },
        labelled_elsewhere=_labelled_elsewhere(units, plan.cfg.stream),
    )


def _labelled_elsewhere(units: bool, stream: bool) -> dict[str, str]:
    """Fields outside ``non_private`` that the guarantee does not cover, each with why."""
    return {
        "dataset.sha256": "a fingerprint of the whole private file: it confirms a guess of the "
        "entire dataset; kept for the audit trail and resume checks",
        "dataset.n_test": "the number of held-out rows",
        **(
            {
                "dataset.n_train": "the number of training rows: with a privacy unit only the "
                "number of units is public by declaration; the row count depends on how many "
                "rows each person has"
            }
            if units
            else {}
        ),
        **(
            {
                "streaming": "how the file was read: windows, row groups read, rows decoded and "
                "the most rows held depend on the realised Poisson batches, and the evaluated "
                "count on the held-out rows; for the operator, like the sampling check's counts"
            }
            if stream
            else {}
        ),
    }


def guarantee_covers(plan: RunPlan, ledger: Ledger) -> str:
    """What the (ε, δ) guarantee covers, in words (the report's ``covers``)."""
    cfg = plan.cfg
    pre = "" if plan.prep.public else " and the DP preprocessing statistic (preprocessing.json)"
    if plan.prepared.whitening is not None:
        pre += " and the DP Gram matrix of the whitening (whitening.npy)"
    units = unit_section(cfg, plan.data, max_rows(plan))
    records = f"{plan.data.n_train} training rows" if units is None else f"{units['units']} training units"
    text = (
        f"the released weights (model.pt){pre}, as a function of the {records}, protecting "
        f"{unit_covers(units)}: all {ledger.steps} charged DP-SGD steps"
        f"{'' if plan.prep.public else ' and the preprocessing release'}"
        f"{'' if plan.prepared.whitening is None else ' and the whitening release'}"
        " are in the ledger. Not covered: "
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
