"""``veil epsilon``: the ε of a DP-SGD run, for a sampling rate, noise multiplier and steps.

The printed ε is always a finite number: σ > 0 is required, and at tiny σ (per-step losses beyond
the PLD grid) the PLD accountant returns a sound but loose bound rather than ∞ (see
:mod:`veil.accounting.pld`). Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import math
from typing import Any

import typer

from veil.accounting.base import AccountantName
from veil.cli import _privacy_args as args
from veil.cli._output import emit
from veil.cli._privacy_args import resolve_sampling
from veil.errors import InvalidParameterError


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
    if not math.isfinite(eps):  # never for σ > 0 (the accountants bound even tiny σ); kept as a guard
        raise InvalidParameterError(
            "noise_multiplier",
            noise_multiplier,
            f"the {accountant} accountant cannot bound ε for this run",
            "use a larger noise multiplier",
        )
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
