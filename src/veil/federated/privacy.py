"""Client-level calibration and accounting, and the record-level guarantee across silos.

Client-level (add/remove-one *client*). One DP-FedAvg round releases ``Σ_{k∈S} clip_C(Δ_k) + N(0,
σ²C²·I)`` where S is a Poisson sample of the clients (each with probability q). Adding or removing
one client changes the sum by at most C in L2, so the round is ``PoissonSampled(q, Gaussian(σ))``
(``Gaussian(σ)`` when q = 1), exactly the event of one DP-SGD step with clients in place of records;
the planned run is ``rounds`` such events, and :func:`client_level_sigma` calibrates σ with veil's
accountant so that they compose to at most the target ε (on the private side, see
:func:`veil.accounting.calibrate.calibrate_noise`). Dividing by the expected count qN and adding
the previous global model are post-processing.

Record-level (add/remove-one *record* of one silo). Silo k runs DP-SGD on its own records and
accounts its own ε_k. A record lives in one silo only, and every other silo's releases depend on it
only through the (already private) global models they receive, so by parallel composition (adaptive
version: each silo's mechanism is DP in its own data for any fixed sequence of public inputs) the
whole run — every silo's updates and the global models — is (max_k ε_k, max_k δ_k)-DP. With one δ
for all silos, the guarantee is (max_k ε_k, δ).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from veil.accounting.base import AccountantName, check_delta, make_accountant
from veil.accounting.calibrate import calibrate_noise, dpsgd_event
from veil.accounting.events import PrivacyEvent
from veil.errors import ConfigError, InvalidParameterError

__all__ = [
    "client_level_epsilon",
    "client_level_sigma",
    "flower_epsilon",
    "record_level_guarantee",
    "round_event",
    "sampling_rate",
]


def sampling_rate(clients: int, rate: float | None, per_round: int | None) -> float:
    """q from ``--client-sampling-rate`` or ``--clients-per-round`` (expected / all clients); 1 if neither."""
    if rate is None and per_round is None:
        return 1.0
    if rate is not None and per_round is not None:
        raise ConfigError(
            "client_sampling_rate",
            rate,
            "the accountant needs exactly one statement of how often a client takes part",
            "pass either --client-sampling-rate Q or --clients-per-round K",
        )
    if per_round is not None:
        if isinstance(per_round, bool) or not isinstance(per_round, int) or per_round < 1:
            raise ConfigError(
                "clients_per_round", per_round, "a round needs at least one expected client", "pass K ≥ 1"
            )
        if per_round > clients:
            raise ConfigError(
                "clients_per_round",
                per_round,
                f"only {clients} clients exist, so no round can expect more; the sampling rate would "
                "exceed 1",
                f"pass --clients-per-round ≤ {clients}",
            )
        return per_round / clients
    assert rate is not None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= 1):
        raise ConfigError(
            "client_sampling_rate",
            rate,
            "a client's probability of taking part in a round must lie in (0, 1]",
            "pass e.g. --client-sampling-rate 0.1",
        )
    return float(rate)


def round_event(q: float, sigma: float) -> PrivacyEvent:
    """The event of one DP-FedAvg round: ``PoissonSampled(q, Gaussian(σ))``, or ``Gaussian(σ)`` at q = 1."""
    return dpsgd_event(q, sigma)


def client_level_sigma(
    epsilon: float, delta: float, q: float, rounds: int, clients: int, accountant: AccountantName = "pld"
) -> float:
    """σ for ``rounds`` Poisson-sampled rounds at rate q to be (ε, δ)-DP at the client level."""
    check_delta(delta)
    if delta >= 1.0 / clients:
        raise InvalidParameterError(
            "delta",
            delta,
            f"δ ≥ 1/N (N = {clients} clients) allows a mechanism that publishes one client's whole data",
            f"pass δ well below 1/N, e.g. {10 ** math.floor(math.log10(1.0 / clients) - 1):g}",
        )
    return float(calibrate_noise(epsilon, delta, q, rounds, accountant=accountant))


def client_level_epsilon(
    events: Sequence[PrivacyEvent], delta: float, accountant: AccountantName = "pld"
) -> float:
    """ε at δ of the charged round events (an empty run: 0)."""
    acc = make_accountant(accountant)
    for event in events:
        acc.compose(event)
    return float(acc.epsilon(delta))


def flower_epsilon(sigma: float, rounds: int, clients: int, delta: float) -> float | None:
    """Flower's own RDP accountant on the one case it covers: every client in every round, fixed C.

    ``None`` when the installed Flower has no accountant. Uses ``flwr.serverapp.RdpAccountant`` with
    no amplification (Flower's fixed-clipping wrappers accept only that sampling method).
    """
    try:
        from flwr.serverapp import (
            GaussianPrivacyEvent,
            NeighboringRelation,
            PrivacyConfig,
            RdpAccountant,
            SamplingMethod,
        )
    except ImportError:  # pragma: no cover - flwr < 1.35
        return None
    config = PrivacyConfig(
        target_delta=delta,
        population_size=clients,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    acc = RdpAccountant(config)
    acc.compose(GaussianPrivacyEvent(sigma, clients, clients), rounds)
    return float(acc.get_epsilon(delta))


def record_level_guarantee(silos: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Parallel composition over disjoint silos: the global ε is the largest silo's ε."""
    if not silos:
        return {"epsilon": 0.0, "composition": "parallel (disjoint silos): no silo has spent budget"}
    worst = max(silos, key=lambda k: float(silos[k]["epsilon"]))
    return {
        "epsilon": float(silos[worst]["epsilon"]),
        "worst_silo": worst,
        "composition": "parallel (disjoint silos): max over silos",
    }
