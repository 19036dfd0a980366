"""Opacus's ``get_noise_multiplier``, answered by veil's calibration (always on the private side)."""

from __future__ import annotations

import math
from typing import Any

from veil.accounting.calibrate import calibrate_noise
from veil.errors import InvalidParameterError

__all__ = ["get_noise_multiplier"]


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: float | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    **kwargs: Any,
) -> float:
    """The smallest σ (to 0.5%) whose ``steps`` Poisson-sampled steps at rate q are (ε, δ)-DP.

    Opacus's signature: give ``steps``, or ``epochs`` (then ``steps = ⌈epochs / sample_rate⌉``, never
    fewer than Opacus's ``int(epochs / sample_rate)``). ``accountant`` takes Opacus's names (``"rdp"``,
    its default here, or ``"prv"`` → veil's PLD; ``"gdp"`` is refused). ``epsilon_tolerance`` is
    accepted and not needed: veil's answer is confirmed with the full-resolution accountant to be at or
    below the target. Unlike Opacus, σ is never below the one the target needs.
    """
    from veil.compat.opacus_args import resolve_accountant

    if kwargs:
        raise InvalidParameterError(
            "kwargs", sorted(kwargs), "unknown arguments to get_noise_multiplier", "remove them"
        )
    if (epochs is None) == (steps is None):
        raise InvalidParameterError(
            "steps",
            steps,
            "the number of steps is given either directly or as epochs, exactly one of them",
            "pass steps= or epochs=",
        )
    if steps is None:
        assert epochs is not None
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, (int, float))
            or not 0 < sample_rate <= 1
        ):
            raise InvalidParameterError(
                "sample_rate", sample_rate, "a sampling rate lies in (0, 1]", "pass q = batch size / N"
            )
        steps = math.ceil(epochs / sample_rate - 1e-9)
    name = resolve_accountant(accountant)
    return calibrate_noise(target_epsilon, target_delta, sample_rate, steps, accountant=name)
