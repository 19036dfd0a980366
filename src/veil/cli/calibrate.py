"""``veil calibrate``: the smallest noise multiplier for a target ε."""

from __future__ import annotations

from typing import Any

import typer

from veil.accounting.base import AccountantName
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
            ..., "--target-epsilon", help="The ε the whole run must stay within."
        ),
        delta: float = typer.Option(..., "--delta", help="Target δ (well below 1/N)."),
        sampling_rate: float = typer.Option(None, "--sampling-rate", help="Poisson sampling rate q."),
        steps: int = typer.Option(None, "--steps", help="Number of noisy steps T."),
        batch_size: int = typer.Option(None, "--batch-size", help="Expected batch size B (q = B/N)."),
        dataset_size: int = typer.Option(None, "--dataset-size", help="Dataset size N."),
        epochs: float = typer.Option(None, "--epochs", help="Epochs E (T = ceil(E·N/B))."),
        accountant: str = typer.Option("pld", "--accountant", help="pld (default, tightest) or rdp."),
        json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Smallest noise multiplier σ whose ε stays within the target (always on the private side)."""
        q, t = resolve_sampling(sampling_rate, steps, batch_size, dataset_size, epochs)
        result = calibrate_report(target_epsilon, q, t, delta, accountant)  # type: ignore[arg-type]
        emit(result, json_output, title="Calibrated noise")
