"""The train job's files: ``model.pt`` (and a table's ``encoder.json``), the plots, ``report.html``
and ``report.json``, then ``release/`` and the folder sealed owner-only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.accounting.ledger import Ledger
from veil.pipeline.outputs import model_bytes
from veil.pipeline.run_folder import write_files
from veil.report import Report

if TYPE_CHECKING:
    from torch import nn

__all__ = ["write_outputs"]


def write_outputs(
    report: Report,
    run_dir: Path,
    model: nn.Module,
    curve: list[tuple[int, float]],
    encoder: Any = None,
    ledger: Ledger | None = None,
    release: bool = True,
) -> None:
    """``model.pt`` (and a table's ``encoder.json``), the plots, ``report.html`` and last ``report.json``,
    each written atomically; then ``release/`` (the model and the public report) and the folder sealed
    owner-only (:func:`veil.report.publish.publish`). ``release=False``: the folder is sealed with no
    ``release/`` in it (a run that is not published on its own, see :func:`execute_run`)."""
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
    if release:
        publish(run_dir, full, {"model.pt": weights, **extra})
    else:
        from veil.pipeline.run_folder import seal

        seal(run_dir)
