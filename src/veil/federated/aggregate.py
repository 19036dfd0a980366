"""Server-side DP aggregation of client updates: clip each to L2 norm C, sum, add Gaussian noise once.

Guarantee (client level, add/remove-one client). :func:`noisy_clipped_sum` returns
``Σ_k clip_C(Δ_k) + N(0, σ²C²·I)`` over the whole flattened update (all arrays together), where
``clip_C(v) = v · min(1, C/‖v‖₂)``; one client more or less moves the sum by at most C, so the
release is the Gaussian mechanism with noise multiplier σ at sensitivity C. Noise comes from the
given :class:`~veil.mechanisms.rng.RandomSource` (the OS CSPRNG unless a research seed was asked for),
never from numpy's global generator. A non-finite update (NaN or inf: no bounded norm) is a failed
client: it adds nothing to the sum (a zero update, like a client that did not reply) and its norm is
reported as NaN, so the run never stops on one client's values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from veil.errors import InvalidParameterError
from veil.mechanisms.rng import RandomSource

__all__ = ["clip_update", "dp_fedavg_step", "noisy_clipped_sum", "update_norm"]

Arrays = list[np.ndarray]


def update_norm(update: Sequence[np.ndarray]) -> float:
    """L2 norm of all arrays of an update taken together (float64)."""
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in update))


def clip_update(update: Sequence[np.ndarray], clip: float) -> tuple[Arrays, float]:
    """``(clip_C(update), ‖update‖)``: scaled down to norm ≤ C, unchanged when already within."""
    norm = update_norm(update)
    if not math.isfinite(norm):
        raise InvalidParameterError(
            "client update",
            "non-finite",
            "an update with NaN or inf has no bounded norm, so clipping cannot bound its influence",
            "check the client's local training (learning rate, data)",
        )
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return [np.asarray(a, dtype=np.float64) * factor for a in update], norm


def noisy_clipped_sum(
    updates: Sequence[Sequence[np.ndarray]],
    shapes: Sequence[tuple[int, ...]],
    clip: float,
    sigma: float,
    source: RandomSource,
) -> tuple[Arrays, list[float]]:
    """``Σ clip_C(Δ_k) + N(0, (σC)²)`` per coordinate (zero updates: noise alone) and the raw norms
    (NaN for a non-finite update, which is left out of the sum: a failed client)."""
    total = [np.zeros(s, dtype=np.float64) for s in shapes]
    norms = []
    for update in updates:
        if not math.isfinite(update_norm(update)):
            norms.append(math.nan)
            continue
        clipped, norm = clip_update(update, clip)
        norms.append(norm)
        for t, c in zip(total, clipped, strict=True):
            t += c
    std = sigma * clip
    noisy = [t + std * source.standard_normal(t.shape) if t.size else t for t in total]
    return noisy, norms


def dp_fedavg_step(
    global_arrays: Sequence[np.ndarray],
    noisy_sum: Sequence[np.ndarray],
    expected_clients: float,
    server_lr: float,
) -> Arrays:
    """``w + η · noisy_sum / (qN)``: the fixed-denominator DP-FedAvg update (post-processing)."""
    return [
        (np.asarray(w, dtype=np.float64) + server_lr * s / expected_clients).astype(np.asarray(w).dtype)
        for w, s in zip(global_arrays, noisy_sum, strict=True)
    ]
