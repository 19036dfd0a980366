"""Option declarations shared by the subcommands that train (`veil train`, `veil audit`)."""

from __future__ import annotations

import typer

DATASET = typer.Option(
    None,
    "--dataset",
    help="digits (default), breast-cancer, fashion-mnist, mnist, csv:PATH, parquet:PATH, npz:PATH, sql:URL.",
)
SCHEMA = typer.Option(
    None, "--schema", help="Reviewed table schema (TOML) for csv:, parquet: or sql: data (docs/tables.md)."
)
TABLE = typer.Option(None, "--table", help="Table of a sql:URL dataset.")
QUERY = typer.Option(None, "--query", help="SQL query of a sql:URL dataset (instead of --table).")
DATA_DIR = typer.Option(None, "--data-dir", help="Folder of the IDX files (fashion-mnist, mnist).")
TARGET = typer.Option(None, "--target", help="Label column (csv, parquet) or label array (npz).")
MODEL = typer.Option(
    None, "--model", help="auto (default), logreg, mlp, cnn, scatternet, rff, or package.module:factory."
)
EPOCHS = typer.Option(None, "--epochs", help="Planned epochs (default: tuned preset).")
BATCH_SIZE = typer.Option(None, "--batch-size", help="Expected logical batch size; q = B/N.")
MAX_GRAD_NORM = typer.Option(None, "--max-grad-norm", help="Per-example clip norm C.")
LR = typer.Option(None, "--lr", help="Learning rate.")
OPTIMIZER = typer.Option(None, "--optimizer", help="sgd (with momentum) or adam.")
ACCOUNTANT = typer.Option(None, "--accountant", help="pld (default, tightest) or rdp.")
REPRODUCIBLE = typer.Option(
    None,
    "--reproducible",
    help="Research mode: noise and sampling seeded by --seed (replayable; NOT private against anyone "
    "who knows the seed; the report is not release-ready). Default: OS CSPRNG.",
)
SECURE_RNG = typer.Option(
    None, "--secure-rng", hidden=True, help="Accepted for old scripts: secure randomness is the default."
)
CLASSES = typer.Option(
    None,
    "--classes",
    help="The public label set, comma-separated in class order (required for csv/parquet/npz data; "
    "built-in datasets declare theirs).",
)
NO_BASELINE = typer.Option(
    None, "--no-baseline", help="Skip the non-private baseline (it trains on the private split)."
)
