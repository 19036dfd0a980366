"""What every job does with its finished report: the plain summary, ``release/`` and the sealed folder.

:func:`plain_summary` writes the one paragraph a reader who is not a privacy expert reads first (no
jargon: no accountant, sampling or neighbouring relation; those stay in the technical statement).
:func:`publish` writes ``release/`` — the released artefacts and the public report (``report.json``
without the ``non_private`` section, and a page made from it alone) — then makes the rest of the run
folder owner-only (:func:`veil.pipeline.run_folder.seal`).

Two things a published folder must not leak beside its files' contents:

* its times. A file's modification time minus the run's public reservation time
  (``dataset_budget.runs[].at``) is the run's duration, which grows with the private rows (the
  Poisson batches' sizes; for ``veil tune`` the number of trials, which its bound assumes secret).
  Every file in ``release/`` and the folder itself carry the run's reservation time
  (:func:`release_time`), public already, as modification and access time, whenever they were
  written. Not covered (revJ's J2): their *change* time (ctime), which the system sets when a file is
  written and no call can set, so it is the time the release was written; ``stat`` shows it and a
  pax tar (``tar --format=posix``) archives it. Nor is the moment the job visibly ends (its process
  exits, its report appears). Both give the duration to whoever sees them, so they are outside the
  guarantee: publish the files' contents, not the folder's metadata — e.g. a zip made with
  ``python -m zipfile -c release.zip release/`` (it keeps each file's modification time, ``at``, and
  no ctime) or the files uploaded one by one — and not at the moment the job ends (docs/train.md).
* its provenance. Each released file's SHA-256 is recorded in the budget registry for the run
  (:mod:`veil.registry.released`), so that ``--init-from`` refuses a DP release of the same rows
  under any path or name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["plain_summary", "public_page", "publish", "release_time"]

_UNIT_WORDS = {
    "row": "any one person's row",
    "group": "any one group of rows (as given by the group ids)",
    "client": "any one client, with everything it holds",
    "record of one silo": "any one record of any one silo",
}


def _num(value: float | None) -> str:
    if value is None:
        return "unknown"
    return "unlimited" if math.isinf(value) else f"{value:.3g}"


def plain_summary(guarantee: Mapping[str, Any], budget: Mapping[str, Any] | None, what: str) -> str:
    """One paragraph in plain words: what ``what`` (the released output) reveals about one person,
    what this run cost and what the dataset has left."""
    from veil.report.html import exp_factor

    eps, delta = guarantee.get("epsilon"), guarantee.get("delta")
    unit = _UNIT_WORDS.get(str(guarantee.get("unit")), "any one person's data")
    if eps is None:
        text = (
            f"This run releases nothing under a privacy guarantee: everything it wrote about {what} "
            "was computed from the private data directly and must stay inside the organisation."
        )
    else:
        text = (
            f"Anyone who sees {what} cannot tell, beyond a factor of e^{_num(eps)} ≈ {exp_factor(eps)} "
            f"in the odds, whether {unit} was part of the data; there is a small chance, at most "
            f"{delta:g}, that this promise fails. Smaller numbers mean stronger privacy."
        )
    if budget:
        left = budget.get("left_epsilon")
        total = budget.get("budget_epsilon")
        spent = budget.get("spent_epsilon")
        text += f" All runs on this dataset together have used {_num(spent)}"
        text += (
            f" of its budget of {_num(total)}, leaving {_num(left)}."
            if total is not None
            else ("; no total budget has been set for it.")
        )
    if guarantee.get("randomness") == "seeded":
        text += (
            " This run used replayable randomness for research: anyone who knows its seed could undo "
            "the protection, so it must not be released."
        )
    elif eps is not None and not guarantee.get("release_ready"):
        text += " A check failed, so it is not ready to release; see the checklist."
    return text


def public_page(report: Mapping[str, Any]) -> str:
    """``release/report.html``: the page of the public report alone (``templates/release.html.j2``)."""
    from veil.report.render import render_page

    job = str(report.get("job"))
    section = report.get(job) or {}
    settings = {  # the job's plain settings; its texts are in the guarantee box already
        k: v
        for k, v in section.items()
        if v is not None and (isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 120))
    }
    return render_page(
        "release.html.j2",
        {},
        r=report,
        summary=report.get("summary", ""),
        g=report["guarantee"],
        dataset_budget=report.get("dataset_budget"),
        settings=settings,
        checks=report.get("checks") or [],
        files=report.get("files") or {},
    )


def _this_run(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """This run's row of the report's ``dataset_budget.runs`` (None: a job the registry has no run for)."""
    budget = report.get("dataset_budget")
    rows = budget.get("runs") if isinstance(budget, Mapping) else None
    return next((r for r in rows or [] if isinstance(r, Mapping) and r.get("this_run")), None)


def release_time(report: Mapping[str, Any]) -> float:
    """The time every file in ``release/`` carries (POSIX seconds): this run's reservation time as the
    public report states it (``dataset_budget.runs[].at``), else 0 (1970-01-01); never a time the
    run's length moves."""
    row = _this_run(report)
    try:
        return datetime.fromisoformat(str(row["at"]).replace("Z", "+00:00")).timestamp() if row else 0.0
    except (KeyError, ValueError):
        return 0.0


def _record_released(report: Mapping[str, Any], artefacts: Mapping[str, bytes | str]) -> None:
    """Record each released file's SHA-256 for this run in the budget registry (the run's open
    charge's registry, else the one in use: :mod:`veil.registry.released`)."""
    import hashlib

    row = _this_run(report)
    if row is None or not row.get("run_id") or not artefacts:
        return
    from veil.registry import released
    from veil.registry.charge import _OPEN, open_registry

    hashes = {
        name: hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()
        for name, data in artefacts.items()
    }
    run_id = str(row["run_id"])
    charge = _OPEN.get(run_id)
    if charge is not None:
        released.record(charge.registry.db, run_id, hashes)
        return
    with open_registry() as registry:
        released.record(registry.db, run_id, hashes)


def publish(run_dir: Path, report: Mapping[str, Any], artefacts: Mapping[str, bytes | str]) -> None:
    """Write ``run_dir/release/`` (``artefacts`` — the released model or table — and the public
    ``report.json`` and ``report.html``), every file and the folder dated :func:`release_time`; record
    the artefacts' hashes for the run in the budget registry; then make everything else in
    ``run_dir`` owner-only."""
    from veil.pipeline.run_folder import seal, write_release
    from veil.report.schema import public_view

    public = public_view(report)
    _record_released(report, artefacts)
    write_release(
        Path(run_dir),
        {
            **artefacts,
            "report.html": public_page(public),
            "report.json": json.dumps(public, indent=2, allow_nan=False) + "\n",
        },
        mtime=release_time(public),
    )
    seal(Path(run_dir))
