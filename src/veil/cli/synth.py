"""``veil synth``: a differentially private synthetic table (MST or AIM). See ``docs/synth.md``."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from veil.accounting.defaults import DEFAULT_DELTA
from veil.cli import _training_options as opts
from veil.cli._mlflow import MLFLOW, MLFLOW_NON_PRIVATE, check_mlflow_flags, log_if_asked
from veil.cli._output import emit
from veil.cli._privacy_args import DELTA_HELP, REGISTRY_DB, secure_randomness


def register(app: typer.Typer) -> None:
    @app.command("synth")
    def synth_command(
        dataset: str = typer.Option(
            ..., "--dataset", help="csv:PATH, parquet:PATH or sql:URL (with --table/--query)."
        ),
        schema: str = typer.Option(..., "--schema", help="The table's reviewed schema (TOML)."),
        epsilon: float = typer.Option(..., "--epsilon", help="Target ε of the whole run."),
        delta: float = typer.Option(DEFAULT_DELTA, "--delta", help=DELTA_HELP),
        rows: int = typer.Option(..., "--rows", help="Rows of the synthetic table."),
        mechanism: str = typer.Option("mst", "--mechanism", help="mst (default) or aim."),
        out: str = typer.Option(None, "--out", help="Run folder (new or empty; default runs/synth-...)."),
        table: str = typer.Option(None, "--table", help="Table of a sql: source."),
        query: str = typer.Option(None, "--query", help="Query of a sql: source."),
        dataset_id: str = typer.Option(
            None, "--dataset-id", help="Declared dataset identity in the budget registry (veil budget)."
        ),
        bins: int = typer.Option(16, "--bins", help="Bins of each numeric column's public bounds."),
        degree: int = typer.Option(3, "--degree", help="AIM's workload: all marginals of this many columns."),
        max_cells: int = typer.Option(
            10_000_000, "--max-cells", help="Largest model, in cells (8 bytes each)."
        ),
        iterations: int = typer.Option(1000, "--iterations", help="Mirror-descent steps of the final fit."),
        reproducible: bool = opts.REPRODUCIBLE,
        secure_rng: bool = typer.Option(
            None,
            "--secure-rng/--no-secure-rng",
            hidden=True,
            help="Deprecated: secure randomness is the default; --no-secure-rng is --reproducible.",
        ),
        seed: int = typer.Option(None, "--seed", help="Seed of the noise of a --reproducible research run."),
        db: str = REGISTRY_DB,
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help="Protect every row sharing this column's value (a person): each person's rows weigh 1 "
            "in every marginal together (docs/synth.md).",
        ),
        json_output: bool = typer.Option(False, "--json", help="Print the report JSON on stdout."),
        mlflow: str = MLFLOW,
        mlflow_non_private: bool = MLFLOW_NON_PRIVATE,
    ) -> None:
        """Write a synthetic table whose release is (ε, δ)-DP, with its report."""
        check_mlflow_flags(mlflow, mlflow_non_private)
        from veil.registry.location import registry_location
        from veil.synth.run import run_synth
        from veil.synth.settings import SynthSettings

        secure = secure_randomness(reproducible, secure_rng)
        settings = SynthSettings(
            dataset=dataset, schema=schema, epsilon=epsilon, delta=delta, rows=rows,
            mechanism=mechanism,  # type: ignore[arg-type]
            out=Path(out) if out else None, table=table, query=query, dataset_id=dataset_id, bins=bins,
            degree=degree,
            max_cells=max_cells, iterations=iterations, secure_rng=secure, seed=seed,
            privacy_unit=privacy_unit,
        )  # fmt: skip
        with registry_location(db):
            report = run_synth(settings)
        log_if_asked(report, mlflow, "synth", mlflow_non_private)
        if json_output:
            emit(report, True)
            return
        folder = Path(report["out_dir"])
        sys.stdout.write(
            f"{report['rows_written']} synthetic rows ({report['mechanism'].upper()}), "
            f"ε = {report['epsilon']:.4g} at δ = {report['delta']:g}; randomness {report['randomness']}\n"
            f"table:  {folder / 'synthetic.csv'}\nreport: {folder / 'report.html'}\n"
        )
