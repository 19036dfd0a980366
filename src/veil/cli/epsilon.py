"""``veil epsilon``: the ε of a DP-SGD run, for a sampling rate, noise multiplier and steps."""

from __future__ import annotations

from typing import Any

import typer

from veil.accounting.base import AccountantName
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
        delta: float = typer.Option(..., "--delta", help="Target δ (well below 1/N)."),
        sampling_rate: float = typer.Option(None, "--sampling-rate", help="Poisson sampling rate q."),
        steps: int = typer.Option(None, "--steps", help="Number of noisy steps T."),
        batch_size: int = typer.Option(None, "--batch-size", help="Expected batch size B (q = B/N)."),
        dataset_size: int = typer.Option(None, "--dataset-size", help="Dataset size N."),
        epochs: float = typer.Option(None, "--epochs", help="Epochs E (T = ceil(E·N/B))."),
        accountant: str = typer.Option("pld", "--accountant", help="pld (default, tightest) or rdp."),
        json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Privacy spent (ε at δ) by a Poisson-sampled DP-SGD run."""
        q, t = resolve_sampling(sampling_rate, steps, batch_size, dataset_size, epochs)
        emit(epsilon_report(q, noise_multiplier, t, delta, accountant), json_output, title="DP-SGD privacy")  # type: ignore[arg-type]
