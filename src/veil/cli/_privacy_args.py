"""Privacy options shared across subcommands: the sampling flags of ``veil epsilon`` and ``veil
calibrate``; the budget registry's ``--db`` and the research-mode ``--reproducible`` of every job."""

from __future__ import annotations

import math

import typer

from veil.accounting.defaults import DEFAULT_DELTA
from veil.errors import InvalidParameterError

# Option declarations shared by `veil epsilon` and `veil calibrate` (typer reads them as defaults).
DELTA_HELP = "Target δ (default 1e-5, the rule of every job; must be below 1/N: docs/accounting.md)."
DELTA = typer.Option(DEFAULT_DELTA, "--delta", help=DELTA_HELP)
SAMPLING_RATE = typer.Option(None, "--sampling-rate", help="Poisson sampling rate q.")
STEPS = typer.Option(None, "--steps", help="Number of noisy steps T.")
BATCH_SIZE = typer.Option(None, "--batch-size", help="Expected batch size B (q = B/N).")
DATASET_SIZE = typer.Option(None, "--dataset-size", help="Dataset size N.")
EPOCHS = typer.Option(None, "--epochs", help="Epochs E (T = ceil(E·N/B)).")
ACCOUNTANT = typer.Option("pld", "--accountant", help="pld (default, tightest) or rdp.")
JSON_OUTPUT = typer.Option(False, "--json", help="Print one JSON object.")

# The budget registry a charged job (train, pate, tune, synth, federated, schema infer) reads and charges.
REGISTRY_DB = typer.Option(
    None,
    "--db",
    help="Budget registry: a SQLite path or SQLAlchemy URL (default: $VEIL_BUDGET_DB, else a per-user "
    "file; see veil budget).",
)


def secure_randomness(reproducible: bool | None, secure_rng: bool | None) -> bool:
    """Whether a job's noise comes from the OS CSPRNG, from ``--reproducible`` and the deprecated
    ``--secure-rng/--no-secure-rng`` of old scripts (which must not contradict it)."""
    if reproducible and secure_rng:
        raise InvalidParameterError(
            "--secure-rng",
            True,
            "it contradicts --reproducible, which seeds the noise",
            "drop --secure-rng (secure randomness is the default)",
        )
    return not (reproducible or secure_rng is False)


def resolve_sampling(
    sampling_rate: float | None,
    steps: int | None,
    batch_size: int | None,
    dataset_size: int | None,
    epochs: float | None,
) -> tuple[float, int]:
    """(q, T) from either ``--sampling-rate/--steps`` or ``--batch-size/--dataset-size/--epochs``.

    q = B/N and T = ceil(E·N/B): the expected number of Poisson-sampled steps in E epochs.
    """
    by_rate = sampling_rate is not None or steps is not None
    by_batch = batch_size is not None or dataset_size is not None or epochs is not None
    if by_rate and by_batch:
        raise InvalidParameterError(
            "--sampling-rate/--steps",
            "given with --batch-size/--dataset-size/--epochs",
            "two descriptions of the sampling could disagree about the rate the guarantee uses",
            "pass either --sampling-rate and --steps, or --batch-size, --dataset-size and --epochs",
        )
    if by_batch:
        for name, value in (
            ("--batch-size", batch_size),
            ("--dataset-size", dataset_size),
            ("--epochs", epochs),
        ):
            if value is None:
                raise InvalidParameterError(
                    name,
                    None,
                    "q = B/N and T = E·N/B need all three",
                    "pass --batch-size, --dataset-size and --epochs",
                )
        assert batch_size is not None and dataset_size is not None and epochs is not None
        if dataset_size < 1 or not (1 <= batch_size <= dataset_size):
            raise InvalidParameterError(
                "--batch-size",
                batch_size,
                f"the expected batch must be between 1 and the dataset size ({dataset_size})",
                "pass 1 ≤ B ≤ N",
            )
        if not (epochs > 0 and math.isfinite(epochs)):
            raise InvalidParameterError(
                "--epochs", epochs, "the number of passes sets the steps spent", "pass E > 0"
            )
        q = batch_size / dataset_size
        return q, max(1, math.ceil(epochs * dataset_size / batch_size - 1e-9))
    if sampling_rate is None or steps is None:
        raise InvalidParameterError(
            "--sampling-rate/--steps",
            None,
            "ε depends on the sampling rate and the number of steps",
            "pass --sampling-rate Q --steps T (or --batch-size, --dataset-size, --epochs)",
        )
    return sampling_rate, steps
