"""``veil predict RUN_DIR --dataset SOURCE --out preds.csv``: predictions of a trained table model."""

from __future__ import annotations

import typer

from veil.cli._output import emit


def register(app: typer.Typer) -> None:
    @app.command("predict")
    def predict_command(
        run_dir: str = typer.Argument(
            ..., metavar="RUN_DIR", help="The folder of a finished veil train run."
        ),
        dataset: str = typer.Option(..., "--dataset", help="New rows: csv:PATH, parquet:PATH or sql:URL."),
        out: str = typer.Option(..., "--out", help="Where to write the predictions (CSV)."),
        table: str = typer.Option(None, "--table", help="Table name (sql: sources)."),
        query: str = typer.Option(None, "--query", help="SQL query (sql: sources)."),
        force: bool = typer.Option(False, "--force", help="Overwrite --out."),
        json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Predict the class of new rows with a model trained on a table, encoded as in training."""
        from veil.predict import predict_table

        summary = predict_table(run_dir, dataset, out, table=table, query=query, force=force)
        emit(summary, json_output, title="predictions")
