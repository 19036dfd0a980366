"""``veil epsilon``: the ε of a DP-SGD run, for a sampling rate, noise multiplier and steps."""

from __future__ import annotations

from typing import Any

import typer

from veil.accounting.base import AccountantName
from veil.cli import _privacy_args as args
from veil.cli._output import emit
from veil.cli._privacy_args import resolve_sampling


def epsilon_report(
    sampling_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: AccountantName = "pld",
) -> dict[str, Any]:
    """The result of ``veil epsilon`` as a dict (stable field names)."""
    from veil.accounting.calibrate import dpsgd_epsilon

    eps = dpsgd_epsilon(sampling_rate, noise_multiplier, steps, delta, accountant)
    return {
        "epsilon": eps,
        "delta": delta,
        "accountant": accountant,
        "sampling_rate": sampling_rate,
        "noise_multiplier": noise_multiplier,
        "steps": steps,
    }


def register(app: typer.Typer) -> None:
    @app.command("epsilon")
    def epsilon_command(
        noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="σ: noise std / clip norm."),
        delta: float = args.DELTA,
        sampling_rate: float = args.SAMPLING_RATE,
        steps: int = args.STEPS,
        batch_size: int = args.BATCH_SIZE,
        dataset_size: int = args.DATASET_SIZE,
        epochs: float = args.EPOCHS,
        accountant: str = args.ACCOUNTANT,
        json_output: bool = args.JSON_OUTPUT,
    ) -> None:
        """Privacy spent (ε at δ) by a Poisson-sampled DP-SGD run."""
        q, t = resolve_sampling(sampling_rate, steps, batch_size, dataset_size, epochs)
        emit(epsilon_report(q, noise_multiplier, t, delta, accountant), json_output, title="DP-SGD privacy")  # type: ignore[arg-type]
