"""``veil budget report``: a static page (and its JSON) for a data-protection officer.

For every dataset in the registry (or one): its budget, the composed spend over time (a plot: the
spend after each charged run, in the order the runs were recorded), and each run with its job, its
own ε at its own δ, who ran it, when it was admitted (never its end: :func:`spent_over_time`), and a
link to its report. Written through the one report stack
(:mod:`veil.report.render`, ``templates/budget.html.j2`` on the shared page skeleton): one
self-contained ``index.html`` (plots embedded) and ``budget.json`` with the same facts.

Nothing here reads a dataset: the registry holds events, δ values, timestamps, users and report
folders, never a row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["budget_report", "spent_over_time", "write_budget_report"]


def spent_over_time(status: Any, runs: Sequence[Any]) -> list[dict[str, Any]]:
    """The composed spend at the status' δ after each charged run (in recorded order), each point at
    the run's admission time.

    Never a run's end: with its start (in the run's own report) the end gives the run's duration, a
    function of the private data's size and content (revH's H6 for ``release/``). The page is the
    data-protection officer's internal one (owner-only: it also holds users and, for a file read
    without ``--dataset-id``, its SHA-256), yet it is the page a DPO files or forwards, so it states no
    time a run's length moves; ``veil budget show`` (the operator's terminal view of the registry)
    keeps the end times."""
    from veil.accounting.events import Neighbouring
    from veil.registry.compose import spent_epsilon

    if status.delta is None or not 0.0 < status.delta < 1.0:
        return []
    relation = Neighbouring(status.neighbouring)
    charged = [r for r in runs if r.charged]
    points = []
    for i, run in enumerate(charged):
        events = [list(r.events) for r in charged[: i + 1]]
        points.append(
            {
                "at": run.created_at,
                "run_id": run.run_id,
                "spent_epsilon": spent_epsilon(events, status.delta, status.accountant, relation),
            }
        )
    return points


def budget_report(registry: Any, identity: Any = None) -> dict[str, Any]:
    """The content of ``budget.json``: every dataset (or ``identity``'s) with its budget section and
    its spend over time."""
    from veil.registry.reporting import budget_section

    statuses = registry.statuses() if identity is None else [registry.status(identity)]
    notes = registry.run_notes()
    datasets = []
    for status in statuses:
        section = budget_section(status, info=notes)
        section["spent_over_time"] = spent_over_time(status, status.runs)
        datasets.append(section)
    return {
        "registry": registry.shown_url,
        "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "datasets": datasets,
    }


def _spent_png(dataset: Mapping[str, Any]) -> bytes | None:
    from veil.report.plots import figure, png_bytes

    points = dataset["spent_over_time"]
    if not points:
        return None
    plt, fig = figure(6.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    times = [datetime.strptime(p["at"], "%Y-%m-%dT%H:%M:%SZ") for p in points]
    ax.step(times, [p["spent_epsilon"] for p in points], where="post", marker="o", label="spent (all runs)")
    if dataset["budget_epsilon"] is not None:
        ax.axhline(dataset["budget_epsilon"], linestyle="--", color="tab:red", label="budget")
    ax.set_ylabel(f"ε (δ = {dataset['spent_delta']:.3g})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"Privacy spent on {dataset['label']}")
    fig.autofmt_xdate()
    return png_bytes(plt, fig)


def _link(report: str | None, out: Path, name: str) -> str | None:
    """A relative link from ``out`` to ``report/name`` (None: no report noted, or the file is gone)."""
    if not report:
        return None
    target = Path(report) / name
    if not target.is_file():
        return None
    return Path(os.path.relpath(target.resolve(), out.resolve())).as_posix()


def write_budget_report(content: Mapping[str, Any], out: Path) -> None:
    """``out/index.html`` and ``out/budget.json`` (out created owner-only if new)."""
    from veil.pipeline.run_folder import write_files
    from veil.report.render import render_page

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, bytes] = {}
    rows = []
    for d in content["datasets"]:
        png = _spent_png(d)
        if png is not None:
            images[f"Privacy spent over time on {d['label']}"] = png
        runs = [
            {
                **r,
                "full": _link(r.get("report"), out, "report.html"),
                "public": _link(r.get("report"), out, "release/report.html"),
            }
            for r in d["runs"]
        ]
        rows.append({**d, "runs": runs})
    checks = [
        {
            "name": f"within budget: {d['label']}",
            "passed": d["budget_epsilon"] is None
            or (d["spent_epsilon"] is not None and d["spent_epsilon"] <= d["budget_epsilon"] * (1 + 1e-9)),
            "detail": "no budget set"
            if d["budget_epsilon"] is None
            else f"spent ε = {d['spent_epsilon']:.4g} of {d['budget_epsilon']:.4g}",
        }
        for d in content["datasets"]
    ]
    page = render_page(
        "budget.html.j2",
        images,
        content=content,
        datasets=rows,
        checks=checks,
        files={"index.html": "this page", "budget.json": "the same facts, machine-readable"},
    )
    write_files(out, {"budget.json": json.dumps(content, indent=2) + "\n", "index.html": page})
