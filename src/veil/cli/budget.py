"""``veil budget set|show|report``: a dataset's total privacy budget across runs, and what was spent on it.

The registry (``veil.registry``) is a database: ``--db URL`` or ``VEIL_BUDGET_DB`` (a path or a
SQLAlchemy URL), by default a SQLite file in the user's data directory. Needs the ``tables`` extra.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import typer

from veil.cli._output import _jsonable

DATASET = typer.Option(None, "--dataset", help="Dataset spec: csv:PATH, parquet:PATH, sql:URL, digits, ...")
DATASET_ID = typer.Option(
    None, "--dataset-id", help="Declared dataset identity (keeps one budget across file versions)."
)
TABLE = typer.Option(None, "--table", help="Table of a sql: dataset.")
QUERY = typer.Option(None, "--query", help="Query of a sql: dataset.")
DATA_DIR = typer.Option(None, "--data-dir", help="Folder of a built-in image dataset's files.")
DB = typer.Option(None, "--db", help="Registry database: a path or URL (default: $VEIL_BUDGET_DB, else XDG).")
JSON_OUTPUT = typer.Option(False, "--json", help="Print one JSON object.")


def _identity(
    dataset: str | None, dataset_id: str | None, table: str | None, query: str | None, data_dir: str | None
) -> Any:
    from veil.registry.identity import dataset_identity

    return dataset_identity(dataset, dataset_id=dataset_id, table=table, query=query, data_dir=data_dir)


def set_budget(
    dataset: str | None,
    epsilon: float,
    delta: float,
    *,
    dataset_id: str | None = None,
    table: str | None = None,
    query: str | None = None,
    data_dir: str | None = None,
    accountant: str | None = None,
    neighbouring: str | None = None,
    privacy_unit: str | None = None,
    db: str | None = None,
) -> dict[str, Any]:
    """The work of ``veil budget set``: the dataset's status after the budget (and unit) is set.

    ``dataset`` with ``dataset_id``: the file is recorded for the name, and runs already charged to
    the file move under it (:mod:`veil.registry.fingerprints`); a file recorded for a name, given
    without one, sets the name's budget.

    ``privacy_unit``: record the column naming the person each row belongs to; from then on every
    run on the dataset must protect that unit (a row-level run is refused before reading)."""
    from veil.registry.charge import open_registry
    from veil.registry.identity import content_fingerprint

    identity = _identity(dataset, dataset_id, table, query, data_dir)
    named_file = (
        content_fingerprint(dataset, table=table, query=query, data_dir=data_dir) if dataset_id else None
    )
    from veil.accounting.base import check_delta, check_epsilon

    check_epsilon(epsilon)  # first: a refused value records nothing (file, unit or budget)
    check_delta(delta)
    with open_registry(db) as registry:
        identity = registry.resolve(identity)  # a file recorded for a name: the name's budget
        # --dataset FILE --dataset-id NAME records the file for the name; --privacy-unit the unit. One
        # transaction with the budget: a refusal of any part writes nothing (revH's H12).
        status = registry.set_budget(
            identity,
            epsilon,
            delta,
            accountant,
            neighbouring,
            fingerprint=named_file,
            privacy_unit=privacy_unit,
        )
        return {"registry": registry.shown_url, **status.to_dict()}


def show_budget(
    dataset: str | None = None,
    *,
    dataset_id: str | None = None,
    table: str | None = None,
    query: str | None = None,
    data_dir: str | None = None,
    db: str | None = None,
) -> dict[str, Any]:
    """The work of ``veil budget show``: every dataset (or one) with its budget, spend and runs."""
    from veil.registry.charge import open_registry

    with open_registry(db) as registry:
        if dataset is None and dataset_id is None:
            statuses = registry.statuses()
        else:
            identity = registry.resolve(_identity(dataset, dataset_id, table, query, data_dir))
            statuses = [registry.status(identity)]
        return {"registry": registry.shown_url, "datasets": [s.to_dict() for s in statuses]}


def report_budget(
    out: str,
    dataset: str | None = None,
    *,
    dataset_id: str | None = None,
    table: str | None = None,
    query: str | None = None,
    data_dir: str | None = None,
    db: str | None = None,
) -> dict[str, Any]:
    """The work of ``veil budget report``: ``out/index.html`` and ``out/budget.json``; returns the JSON."""
    from pathlib import Path

    from veil.registry.charge import open_registry
    from veil.report.budget_page import budget_report, write_budget_report

    identity = None
    if dataset is not None or dataset_id is not None:
        identity = _identity(dataset, dataset_id, table, query, data_dir)
    with open_registry(db) as registry:
        content = budget_report(registry, None if identity is None else registry.resolve(identity))
    write_budget_report(content, Path(out))
    return content


def _eps(value: float | None) -> str:
    if value is None:
        return "-"
    return "∞" if math.isinf(value) else f"{value:.4g}"


def _print_status(status: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    budget = (
        f"ε = {_eps(status['epsilon_budget'])}, δ = {status['delta_budget']:g}"
        if status["epsilon_budget"] is not None
        else "none set"
    )
    at = f" at δ = {status['delta']:g}" if status["delta"] is not None else ""
    remaining = _eps(status["remaining_epsilon"])
    if status["over_budget"]:
        remaining += " (over budget)"
    dataset_id = status["dataset_id"]
    shown_id = dataset_id if len(dataset_id) <= 24 else dataset_id[:23] + "…"
    console.print(f"[bold]{status['label']}[/bold]  ({shown_id})")
    unit = status.get("privacy_unit")
    console.print(
        f"  protects each person (unit column `{unit}`), whatever number of rows they have"
        if unit
        else "  protects single rows (no privacy unit recorded)"
    )
    console.print(f"  budget {budget}; remaining ε = {remaining}")
    console.print(
        f"  spent ε = {_eps(status['spent_epsilon'])}{at} ({status['accountant']}, composed over all "
        "charged runs)"
    )
    files = status.get("fingerprints") or []
    if files:
        console.print(
            "  files recorded for this name (a run on one without --dataset-id is charged here): "
            + ", ".join(f[: f.index(":") + 13] + "…" for f in files)
        )
    jobs = status.get("jobs") or {}
    if jobs:
        console.print(
            "  charged runs by job: " + ", ".join(f"{job} × {n}" for job, n in sorted(jobs.items()))
        )
    if not status["runs"]:
        console.print("  no runs recorded")
        return
    console.print(_runs_table(status["runs"]))
    if any(run["status"] == "reserved" for run in status["runs"]):
        console.print("  * reserved: not finished (or killed), charged as planned")


SHORT_ID = 8
"""Characters of a run id shown in the table (``--json`` has the whole id); enough to tell runs apart."""


def short_id(run_id: str) -> str:
    return run_id[:SHORT_ID]


def _when(stamp: str | None, date: bool) -> str:
    """``2026-12-01T15:30:12Z`` as ``2026-12-01 15:30`` (``date=False``: ``15:30``)."""
    if not stamp:
        return "-"
    day, _, clock = stamp.rstrip("Z").partition("T")
    return f"{day} {clock[:5]}" if date else clock[:5]


def _runs_table(runs: list[dict[str, Any]]) -> Any:
    """The run history, each run's ε alone at its own δ, narrow enough for 80 columns."""
    from rich.table import Table

    table = Table(box=None, padding=(0, 1), pad_edge=False)
    for name in ("  run", "job", "status", "ε alone", "at δ", "started (UTC)", "ended"):
        table.add_column(name, no_wrap=True)
    for run in runs:
        charged = run["charged"]
        table.add_row(
            "  " + short_id(run["run_id"]),
            run["job"],
            run["status"] + ("*" if run["status"] == "reserved" else ""),
            _eps(run["epsilon"]) if charged else "0",
            f"{run['epsilon_delta']:.0e}" if charged and run.get("epsilon_delta") else "-",
            _when(run["created_at"], date=True),
            _when(run["finished_at"], date=False),
        )
    return table


def register(app: typer.Typer) -> None:
    budget_app = typer.Typer(
        name="budget",
        help="A dataset's total privacy budget across runs: set it, show what was spent.",
        no_args_is_help=True,
    )

    @budget_app.command("set")
    def set_command(
        epsilon: float = typer.Option(
            ..., "--epsilon", help="Total ε allowed on the dataset, all runs together."
        ),
        delta: float = typer.Option(..., "--delta", help="The δ the total is stated at."),
        dataset: str = DATASET,
        dataset_id: str = DATASET_ID,
        table: str = TABLE,
        query: str = QUERY,
        data_dir: str = DATA_DIR,
        accountant: str = typer.Option(
            None,
            "--accountant",
            help="auto (default: the tighter of PLD and RDP that bounds every run), pld or rdp.",
        ),
        neighbouring: str = typer.Option(
            None, "--neighbouring", help="add_or_remove_one (default) or replace_one."
        ),
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help="Record the column naming each row's person: every run must then protect that unit "
            "(a row-level run is refused before reading).",
        ),
        db: str = DB,
        json_output: bool = JSON_OUTPUT,
    ) -> None:
        """Set a dataset's total budget; a run that would exceed it is refused before reading data."""
        result = set_budget(
            dataset,
            epsilon,
            delta,
            dataset_id=dataset_id,
            table=table,
            query=query,
            data_dir=data_dir,
            accountant=accountant,
            neighbouring=neighbouring,
            privacy_unit=privacy_unit,
            db=db,
        )
        if json_output:
            sys.stdout.write(json.dumps(_jsonable(result)) + "\n")
            return
        _print_status(result)

    @budget_app.command("show")
    def show_command(
        dataset: str = DATASET,
        dataset_id: str = DATASET_ID,
        table: str = TABLE,
        query: str = QUERY,
        data_dir: str = DATA_DIR,
        db: str = DB,
        json_output: bool = JSON_OUTPUT,
    ) -> None:
        """Each dataset's budget, composed spend, remaining budget and run history."""
        result = show_budget(
            dataset, dataset_id=dataset_id, table=table, query=query, data_dir=data_dir, db=db
        )
        if json_output:
            sys.stdout.write(json.dumps(_jsonable(result)) + "\n")
            return
        if not result["datasets"]:
            sys.stdout.write(f"no dataset recorded in {result['registry']}\n")
        for status in result["datasets"]:
            _print_status(status)

    @budget_app.command("report")
    def report_command(
        out: str = typer.Option(..., "--out", help="Folder for index.html and budget.json."),
        dataset: str = DATASET,
        dataset_id: str = DATASET_ID,
        table: str = TABLE,
        query: str = QUERY,
        data_dir: str = DATA_DIR,
        db: str = DB,
        json_output: bool = JSON_OUTPUT,
    ) -> None:
        """A page for a data-protection officer: every dataset's budget, spend over time and runs.

        Example: veil budget report --out budget-report   (then open budget-report/index.html)"""
        result = report_budget(
            out, dataset, dataset_id=dataset_id, table=table, query=query, data_dir=data_dir, db=db
        )
        if json_output:
            sys.stdout.write(json.dumps(_jsonable(result)) + "\n")
            return
        sys.stdout.write(f"{len(result['datasets'])} dataset(s): {out}/index.html, {out}/budget.json\n")

    app.add_typer(budget_app, name="budget")
