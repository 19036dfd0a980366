"""The federated server samples clients at the rate the charge assumes (issue 23, planted bug: the
server sampling at 2q while every round is charged at q). The report's participation check compares
the clients sampled over all rounds with Binomial(clients · rounds, q)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.federated.strategy import PoissonDPFedAvg
from veil.mechanisms.rng import make_source
from veil.pipeline.checks import participation_check

CLIENTS, ROUNDS, Q = 200, 500, 0.1
"""Binomial(100 000, 0.1): sd ≈ 95; 1.1q moves the mean by 1000 (10.5 sd), 2q by 10 000; the check's
6 sd bound fails a correct sampler with probability about 2e-9 (the draws below are seeded)."""


def _server_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Clients the real strategy samples in each of ROUNDS rounds (its messages are not sent)."""
    from flwr.app import ArrayRecord, ConfigRecord

    counts: list[int] = []
    strategy = PoissonDPFedAvg(
        sampling_rate=Q, clip=1.0, noise_multiplier=1.0, expected_clients=CLIENTS * Q, server_lr=1.0,
        sampling_source=make_source(False, 5), noise_source=make_source(False, 6),
        charge=lambda r, sampled: counts.append(len(sampled)),
    )  # fmt: skip
    monkeypatch.setattr(strategy, "_construct_messages", lambda record, nodes, kind: [])
    grid = InProcessGrid(lambda message, context: message, CLIENTS)  # type: ignore[arg-type,return-value]
    arrays = ArrayRecord([np.zeros(3)])
    for r in range(1, ROUNDS + 1):
        list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
    return counts


def test_the_server_samples_clients_at_the_accounted_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _server_counts(monkeypatch)
    assert len(counts) == ROUNDS
    check = participation_check(counts, CLIENTS, Q)
    assert check.passed, check.detail
    assert check.name == "poisson_client_sampling_matches_accountant"


@pytest.mark.parametrize(("rate", "passes"), [(Q, True), (1.1 * Q, False), (2 * Q, False)])
def test_the_participation_check_rejects_a_wrong_rate(rate: float, passes: bool) -> None:
    rng = np.random.default_rng(20261201)
    counts = rng.binomial(CLIENTS, rate, size=ROUNDS).tolist()
    assert participation_check(counts, CLIENTS, Q).passed is passes


def test_the_report_carries_the_participation_check(tmp_path: object) -> None:
    from pathlib import Path

    from veil.federated.apps import make_client_app
    from veil.federated.privacy import client_level_sigma
    from veil.federated.report import build_report
    from veil.federated.server import serve
    from veil.federated.settings import FederatedSettings

    s = FederatedSettings(mode="client-level", dataset="digits", clients=8, rounds=3, epsilon=4.0,
                          delta=1e-3, sampling_rate=0.5, seed=3, out=str(tmp_path), node_timeout=5.0,
                          model="logreg")  # fmt: skip
    s = s.replace(sigma=client_level_sigma(s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients, "rdp"))
    serve(InProcessGrid(make_client_app(s), s.clients), s)
    report = build_report(Path(str(tmp_path)))
    (check,) = [c for c in report["checks"] if c["name"] == "poisson_client_sampling_matches_accountant"]
    assert check["passed"] and "over 3 rounds of 8" in check["detail"]
