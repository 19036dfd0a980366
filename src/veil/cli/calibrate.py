"""``veil calibrate``: the smallest noise multiplier for a target ε."""

from __future__ import annotations

from typing import Any

import typer

from veil.accounting.base import AccountantName
from veil.cli import _privacy_args as args
from veil.cli._output import emit
from veil.cli._privacy_args import resolve_sampling


def calibrate_report(
    target_epsilon: float, sampling_rate: float, steps: int, delta: float, accountant: AccountantName = "pld"
) -> dict[str, Any]:
    """The result of ``veil calibrate`` as a dict: σ and the ε it actually achieves (≤ target)."""
    from veil.accounting.calibrate import calibrate_noise, dpsgd_epsilon

    sigma = calibrate_noise(target_epsilon, delta, sampling_rate, steps, accountant)
    return {
        "noise_multiplier": sigma,
        "epsilon": dpsgd_epsilon(sampling_rate, sigma, steps, delta, accountant),
        "target_epsilon": target_epsilon,
        "delta": delta,
        "accountant": accountant,
        "sampling_rate": sampling_rate,
        "steps": steps,
    }


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_command(
        target_epsilon: float = typer.Option(
            ..., "--epsilon", "--target-epsilon", help="The ε the whole run must stay within."
        ),
        delta: float = args.DELTA,
        sampling_rate: float = args.SAMPLING_RATE,
        steps: int = args.STEPS,
        batch_size: int = args.BATCH_SIZE,
        dataset_size: int = args.DATASET_SIZE,
        epochs: float = args.EPOCHS,
        accountant: str = args.ACCOUNTANT,
        json_output: bool = args.JSON_OUTPUT,
    ) -> None:
        """Smallest noise multiplier σ whose ε stays within the target (always on the private side)."""
        q, t = resolve_sampling(sampling_rate, steps, batch_size, dataset_size, epochs)
        result = calibrate_report(target_epsilon, q, t, delta, accountant)  # type: ignore[arg-type]
        emit(result, json_output, title="Calibrated noise")
