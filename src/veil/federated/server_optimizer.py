"""The server's step on the noisy mean update of client-level DP-FedAvg (FedAvgM, FedAdam).

Each round the server holds ``g = noisy_sum / (qN)``, already released by the Gaussian mechanism
(:mod:`veil.federated.aggregate`). What it does with ``g`` — a plain step ``w + η·g``, a heavy-ball
step with momentum (FedAvgM; Hsu et al. 2019, the server momentum of McMahan et al. 2018's DP-FedAvg)
or an adaptive Adam step (FedAdam; Reddi et al. 2021) — reads nothing but past noisy means and public
settings, so it is post-processing: the guarantee of the run is the rounds' events, whichever step.

Written as a pair of pure functions over an explicit state (optax's ``init``/``update``):
:func:`init_state` gives the state for the model's shapes, :func:`server_step` returns the new model
and state. The state (named arrays) is saved with the checkpoint, so a resumed run continues it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from veil.errors import ConfigError

__all__ = [
    "SERVER_OPTIMIZERS",
    "ServerOptimizerName",
    "State",
    "check_server_optimizer",
    "init_state",
    "server_step",
]

ServerOptimizerName = Literal["sgd", "momentum", "adam"]
SERVER_OPTIMIZERS: tuple[ServerOptimizerName, ...] = ("sgd", "momentum", "adam")

ADAM_BETA2 = 0.99
ADAM_TAU = 1e-3
"""FedAdam's second-moment decay and adaptivity τ (Reddi et al. 2021's defaults)."""

State = dict[str, np.ndarray]


def check_server_optimizer(name: str, momentum: float) -> None:
    """A known step and a momentum in [0, 1) (a public setting; refused before any data is read)."""
    if name not in SERVER_OPTIMIZERS:
        raise ConfigError(
            "server_optimizer", name, "unknown server step", f"use one of {list(SERVER_OPTIMIZERS)}"
        )
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (0 <= momentum < 1):
        raise ConfigError(
            "server_momentum",
            momentum,
            "a momentum (first-moment decay) must lie in [0, 1), else past updates never fade",
            "pass e.g. --server-momentum 0.9",
        )


def init_state(name: ServerOptimizerName, shapes: Sequence[tuple[int, ...]]) -> State:
    """Zero moments for the model's arrays (none for plain SGD)."""
    state: State = {}
    if name in ("momentum", "adam"):
        state |= {f"m_{i}": np.zeros(s, dtype=np.float64) for i, s in enumerate(shapes)}
    if name == "adam":
        state |= {f"v_{i}": np.zeros(s, dtype=np.float64) for i, s in enumerate(shapes)}
        state["t"] = np.zeros((), dtype=np.float64)
    return state


def server_step(
    name: ServerOptimizerName,
    weights: Sequence[np.ndarray],
    mean_update: Sequence[np.ndarray],
    state: State,
    lr: float,
    momentum: float,
) -> tuple[list[np.ndarray], State]:
    """``(new weights, new state)`` after one server step on the noisy ``mean_update``.

    sgd: ``w + η·g``; momentum: ``m ← β·m + g``, ``w + η·m``; adam: ``m ← β·m + (1−β)·g``,
    ``v ← β₂·v + (1−β₂)·g²``, ``w + η·m̂ / (√v̂ + τ)`` with bias-corrected ``m̂, v̂``.
    """
    new_state: State = dict(state)
    out: list[np.ndarray] = []
    t = float(state["t"]) + 1.0 if name == "adam" else 0.0
    for i, (w, g) in enumerate(zip(weights, mean_update, strict=True)):
        w64 = np.asarray(w, dtype=np.float64)
        g64 = np.asarray(g, dtype=np.float64)
        if name == "sgd":
            step = g64
        elif name == "momentum":
            step = momentum * state[f"m_{i}"] + g64
            new_state[f"m_{i}"] = step
        else:
            m = momentum * state[f"m_{i}"] + (1.0 - momentum) * g64
            v = ADAM_BETA2 * state[f"v_{i}"] + (1.0 - ADAM_BETA2) * g64 * g64
            new_state[f"m_{i}"], new_state[f"v_{i}"] = m, v
            m_hat = m / (1.0 - momentum**t) if momentum > 0 else m
            v_hat = v / (1.0 - ADAM_BETA2**t)
            step = m_hat / (np.sqrt(v_hat) + ADAM_TAU)
        out.append((w64 + lr * step).astype(np.asarray(w).dtype))
    if name == "adam":
        new_state["t"] = np.asarray(t)
    return out, new_state
