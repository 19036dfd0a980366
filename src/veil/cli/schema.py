"""``veil schema infer FILE --target COL --out SCHEMA.toml [--epsilon E]``: draft or DP-release a schema."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from veil.accounting.defaults import DEFAULT_RELEASE_DELTA
from veil.cli._output import emit
from veil.cli._privacy_args import REGISTRY_DB
from veil.errors import ConfigError

if TYPE_CHECKING:
    from veil.accounting.events import PrivacyEvent


def run_infer(
    dataset: str,
    target: str,
    out: str,
    *,
    epsilon: float | None = None,
    delta: float = DEFAULT_RELEASE_DELTA,
    table: str | None = None,
    query: str | None = None,
    ignore: list[str] | None = None,
    max_levels: int = 100,
    force: bool = False,
    dataset_id: str | None = None,
    privacy_unit: str | None = None,
) -> dict[str, Any]:
    """The work of ``veil schema infer``; writes ``out`` (atomically) and returns a summary.

    With ``epsilon`` the release is charged to the dataset's privacy budget (``veil budget``), checked
    before a row is read; a draft (no ``epsilon``) is not private, says so, and is not charged."""
    from veil.tables.infer import MAX_LEVELS, describe, infer_schema
    from veil.tables.schema import write_schema
    from veil.tables.sources import parse_source

    path = Path(out).expanduser()
    if path.exists() and not force:
        raise ConfigError(
            "--out",
            str(path),
            "the file exists and a reviewed schema must not be overwritten by a draft",
            "choose another path, or pass --force",
        )
    if not path.parent.is_dir():
        raise ConfigError("--out", str(path), "its folder does not exist", "create the folder first")
    source = parse_source(dataset, table=table, query=query)
    ignored = list(ignore or [])
    if epsilon is None:  # a draft: not private, labelled so in the file, and not a DP spend
        result = infer_schema(
            source,
            target=target,
            delta=delta,
            ignore=ignored,
            max_levels=max_levels or MAX_LEVELS,
            privacy_unit=privacy_unit,
        )
        write_schema(result.schema, path, result.header, result.notes)
        return {"schema": str(path), "source": source.describe(), **describe(result)}
    return _release_charged(
        dataset,
        source,
        path,
        target,
        epsilon,
        delta,
        ignored,
        max_levels or MAX_LEVELS,
        dataset_id,
        privacy_unit,
    )


def _release_charged(
    dataset: str,
    source: Any,
    path: Path,
    target: str,
    epsilon: float,
    delta: float,
    ignored: list[str],
    max_levels: int,
    dataset_id: str | None,
    privacy_unit: str | None = None,
) -> dict[str, Any]:
    """The DP release, charged to the dataset's budget: the dataset is identified and its budget checked
    before a row is read, the plan (:func:`veil.tables.infer.dp_plan`: every release the inference may
    make) reserved before the first release, and the charge settled to what was released — or, if it
    stopped after reading rows but before releasing anything, to its plan (never released once read).
    Through the pipeline's private-data path (:mod:`veil.pipeline.private_data`)."""
    import dataclasses
    import uuid

    from veil.pipeline.private_data import DataRef, open_account
    from veil.tables.infer import check_columns_named, describe, dp_plan, infer_schema
    from veil.tables.schema import write_schema

    names = check_columns_named(source, target, ignored, privacy_unit)  # typos refused before the charge
    account = open_account(
        DataRef(dataset, dataset_id, source.table, source.query, privacy_unit=privacy_unit), job="schema"
    )
    try:
        read = [n for n in names if n not in ignored and n != privacy_unit]
        plan = dp_plan(read, target, epsilon, delta, secure=True) if target in read else []
        run_id = uuid.uuid4().hex
        if plan:
            account.reserve(plan, run_id, delta)
        spent: list[PrivacyEvent] = []
        account.reading()
        try:
            result = infer_schema(
                source,
                target=target,
                epsilon=epsilon,
                delta=delta,
                ignore=ignored,
                max_levels=max_levels,
                spent=spent,
                privacy_unit=privacy_unit,
            )
            # the schema is shared: it names the dataset by its released id, never by the SHA-256
            # of the private file (the registry's key, which anyone knowing all rows but one inverts)
            budget = {"budget_run_id": run_id, "budget_dataset_id": account.released_id()}
            schema = dataclasses.replace(result.schema, dp={**result.schema.dp, **budget})
            write_schema(schema, path, result.header, result.notes)
        finally:
            account.finish(spent or None)  # nothing released: the plan stands once rows were read
    finally:
        account.close()
    return {"schema": str(path), "source": source.describe(), "budget_run_id": run_id, **describe(result)}


def run_check(
    schema_path: str, dataset: str, *, table: str | None = None, query: str | None = None
) -> dict[str, Any]:
    """The work of ``veil schema check``: read and encode the whole table and count what the
    per-record rules did (rows dropped for an undeclared or missing label, or by a ``"drop"`` policy of
    the schema; cells not a number made missing). No value is refused once reading has begun.

    Not private, by design: a tool for the data owner, who may see the rows anyway. Every count is
    exact and labelled so; nothing is charged or recorded in the budget registry (revH's H14: it is
    the owner's direct access, like opening the file, not a job whose output may leave)."""
    from veil.tables.encoder import TableEncoder
    from veil.tables.schema import load_schema
    from veil.tables.sources import iter_source, parse_source, source_columns

    schema = load_schema(schema_path)
    source = parse_source(dataset, table=table, query=query)
    has_target = schema.target is not None and schema.target.name in source_columns(source)
    rows, batches = iter_source(source, schema, need_target=has_target)
    encoded = TableEncoder(schema).encode_batches(
        rows, batches, with_target=has_target, where=source.describe()
    )
    return {
        "schema": schema_path,
        "reviewed": schema.reviewed,
        "source": source.describe(),
        "rows (not private: for your eyes only)": int(encoded.x.shape[0]),
        "features": int(encoded.x.shape[1]),
        "classes": ", ".join(encoded.classes) or "-",
        **{
            f"{rule.replace('_', ' ')} (not private)": count for rule, count in encoded.rules.items() if count
        },
    }


def register(app: typer.Typer) -> None:
    schema_app = typer.Typer(
        help="Table schemas: the public facts (types, bounds, levels, classes) a model may use.",
        no_args_is_help=True,
    )

    @schema_app.command("infer")
    def infer_command(
        dataset: str = typer.Argument(..., metavar="FILE", help="csv:PATH, parquet:PATH, sql:URL or a path."),
        target: str = typer.Option(..., "--target", help="The label column."),
        out: str = typer.Option(..., "--out", help="Where to write the schema TOML."),
        epsilon: float = typer.Option(
            None, "--epsilon", help="Release bounds and levels with DP at this ε (else: a non-private draft)."
        ),
        delta: float = typer.Option(
            DEFAULT_RELEASE_DELTA,
            "--delta",
            help="δ of the DP release's thresholds (default 1e-7: a hundredth of a job's default, since it "
            "adds to every later run's δ; docs/accounting.md).",
        ),
        table: str = typer.Option(None, "--table", help="Table name (sql: sources)."),
        query: str = typer.Option(None, "--query", help="SQL query (sql: sources)."),
        ignore: list[str] = typer.Option(None, "--ignore", help="A column not to read (repeatable)."),
        max_levels: int = typer.Option(100, "--max-levels", help="Most levels a categorical may get."),
        force: bool = typer.Option(False, "--force", help="Overwrite --out."),
        dataset_id: str = typer.Option(
            None, "--dataset-id", help="Declared dataset identity in the budget registry (veil budget)."
        ),
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help='The column naming each row\'s person: written type = "ignored"; with --epsilon the release '
            "protects people (one drawn row per person).",
        ),
        db: str = REGISTRY_DB,
        json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Draft a schema from the data (reviewed = false) or release it with DP (reviewed = "dp")."""
        from veil.registry.location import registry_location

        with registry_location(db):
            summary = run_infer(
                dataset,
                target,
                out,
                epsilon=epsilon,
                delta=delta,
                table=table,
                query=query,
                ignore=ignore,
                max_levels=max_levels,
                force=force,
                dataset_id=dataset_id,
                privacy_unit=privacy_unit,
            )
        emit(summary, json_output, title="schema")
        if not json_output and summary["reviewed"] is False:
            sys.stdout.write(
                "This draft is NOT private: review every bound, level and class, then set reviewed = true.\n"
            )

    @schema_app.command("check")
    def check_command(
        schema: str = typer.Argument(
            ..., metavar="SCHEMA.toml", help="The schema to check the data against."
        ),
        dataset: str = typer.Option(..., "--dataset", help="csv:PATH, parquet:PATH, sql:URL or a path."),
        table: str = typer.Option(None, "--table", help="Table name (sql: sources)."),
        query: str = typer.Option(None, "--query", help="SQL query (sql: sources)."),
        json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """NOT PRIVATE, for the data owner's eyes only: read and encode the whole table with the schema
        and print exact counts (rows, rows each per-record rule dropped, cells made missing). No value
        is refused; nothing is charged or recorded in the budget registry, so its output is never for
        release: each count is an exact query on the private rows."""
        emit(run_check(schema, dataset, table=table, query=query), json_output, title="schema check")

    app.add_typer(schema_app, name="schema")
