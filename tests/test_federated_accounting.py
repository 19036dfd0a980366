"""Client-level accounting, sampling and aggregation of veil.federated (no Flower runtime needed:
the veil strategies run on an in-process Grid that calls the ClientApp directly)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.accounting.calibrate import dpsgd_epsilon
from veil.federated.aggregate import clip_update, noisy_clipped_sum
from veil.federated.apps import make_client_app
from veil.federated.privacy import client_level_sigma, flower_epsilon
from veil.federated.report import build_report
from veil.federated.server import serve
from veil.federated.settings import FederatedSettings
from veil.federated.strategy import poisson_sample
from veil.mechanisms.rng import make_source


def _settings(tmp_path, **kw) -> FederatedSettings:
    base = dict(
        mode="client-level",
        dataset="digits",
        clients=8,
        rounds=4,
        epsilon=4.0,
        delta=1e-3,
        sampling_rate=0.5,
        seed=3,
        out=str(tmp_path),
        node_timeout=5.0,
        model="logreg",
    )
    sigma = kw.pop("sigma", None)
    base.update(kw)
    s = FederatedSettings(**base)
    if sigma is None:
        sigma = client_level_sigma(s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients, "rdp")
    return s.replace(sigma=sigma)


def test_client_level_epsilon_is_the_accountants_for_poisson_sampled_gaussian_rounds(tmp_path):
    s = _settings(tmp_path, rounds=3)
    serve(InProcessGrid(make_client_app(s), s.clients), s)
    report = build_report(tmp_path)
    g = report["guarantee"]
    assert g["rounds_charged"] == s.rounds
    ours = dpsgd_epsilon(s.sampling_rate, s.sigma, s.rounds, s.delta)
    assert g["epsilon_spent"] == pytest.approx(ours, rel=1e-12)
    assert g["epsilon_spent"] <= s.epsilon
    # Independent reference: dp-accounting's PLD accountant on the same events.
    from dp_accounting import dp_event, pld

    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_event.PoissonSampledDpEvent(s.sampling_rate, dp_event.GaussianDpEvent(s.sigma)), s.rounds)
    assert g["epsilon_spent"] == pytest.approx(acc.get_epsilon(s.delta), rel=0.02)
    assert report["checks"] and all(c["passed"] for c in report["checks"])
    assert report["release_ready"] is False and "seeded" in report["randomness"]


def test_no_sampling_fixed_clipping_is_reported_beside_flowers_own_accountant(tmp_path):
    s = _settings(tmp_path, sampling_rate=1.0, clients=4, rounds=3)
    serve(InProcessGrid(make_client_app(s), s.clients), s)
    g = build_report(tmp_path)["guarantee"]
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    flower = RdpAccountant(
        PrivacyConfig(
            s.delta, s.clients, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION
        )
    )
    flower.compose(GaussianPrivacyEvent(s.sigma, s.clients, s.clients), s.rounds)
    assert g["flower_rdp_epsilon"] == pytest.approx(flower.get_epsilon(s.delta), rel=1e-9)
    # Same Gaussian rounds: veil's RDP accountant agrees with Flower's; its PLD is at least as tight.
    assert dpsgd_epsilon(1.0, s.sigma, s.rounds, s.delta, "rdp") == pytest.approx(
        g["flower_rdp_epsilon"], rel=0.03
    )
    assert g["epsilon_spent"] <= g["flower_rdp_epsilon"] + 1e-9
    assert flower_epsilon(s.sigma, s.rounds, s.clients, s.delta) == pytest.approx(g["flower_rdp_epsilon"])


def test_every_round_is_on_disk_before_any_client_sees_it(tmp_path):
    s = _settings(tmp_path, sampling_rate=1.0, clients=3, rounds=3)
    inner = make_client_app(s)
    seen: list[tuple[int, int]] = []

    def client(msg, context):
        r = int(msg.content["config"]["server-round"])
        charged = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
        seen.append((r, sum(1 for c in charged if c["kind"] == "step")))
        return inner(msg, context)

    serve(InProcessGrid(client, s.clients), s)  # type: ignore[arg-type]
    assert seen and all(charged >= r for r, charged in seen)


def test_poisson_client_sampling_is_independent_with_rate_q_and_may_be_empty():
    # 400 rounds × 50 nodes at q = 0.2: inclusion count ~ Binomial(20000, 0.2), sd ≈ 56.6; a 5-sd band
    # fails with probability < 1e-6 for a correct sampler (seeded, so deterministic here).
    source = make_source(False, 11)
    nodes = list(range(100, 150))
    sizes = [len(poisson_sample(nodes, 0.2, source)) for _ in range(400)]
    assert abs(sum(sizes) - 4000) < 5 * math.sqrt(20000 * 0.2 * 0.8)
    assert len(set(sizes)) > 5  # random sizes, not a fixed fraction
    tiny = [len(poisson_sample(nodes, 0.01, source)) for _ in range(100)]
    assert 0 in tiny  # empty rounds happen (P(empty) = 0.99^50 ≈ 0.6 per round)


def test_an_empty_round_is_charged_and_noised(tmp_path):
    s = _settings(tmp_path, sampling_rate=0.001, clients=4, rounds=2, sigma=2.0)
    grid = InProcessGrid(make_client_app(s), s.clients)
    serve(grid, s)
    assert [len(x) for x in grid.sent if x] == []  # nobody sampled (P ≈ 0.992 per run, seeded)
    history = json.loads((tmp_path / "history.json").read_text())["rounds"]
    assert [h["replied"] for h in history[1:]] == [0, 0]
    report = build_report(tmp_path)
    assert report["guarantee"]["rounds_charged"] == 2
    with np.load(tmp_path / "model.npz") as z, np.load(tmp_path / "checkpoint.npz") as c:
        assert not np.array_equal(z["arr_0"], np.zeros_like(z["arr_0"]))
        assert int(c["round"]) == 2


def test_clipped_sum_matches_a_naive_loop_and_bounds_each_client():
    rng = np.random.default_rng(0)
    updates = [[rng.normal(size=(3, 2)) * s, rng.normal(size=4) * s] for s in (0.1, 1.0, 10.0)]
    got, norms = noisy_clipped_sum(
        updates, [(3, 2), (4,)], clip=1.5, sigma=1e-12, source=make_source(False, 0)
    )
    want = [np.zeros((3, 2)), np.zeros(4)]
    for u in updates:
        n = math.sqrt(sum(float((a**2).sum()) for a in u))
        for w, a in zip(want, u, strict=True):
            w += a * min(1.0, 1.5 / n)
        clipped, _ = clip_update(u, 1.5)
        assert math.sqrt(sum(float((a**2).sum()) for a in clipped)) <= 1.5 * (1 + 1e-12)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-9)
    assert norms[2] > 1.5


def test_noise_on_the_sum_has_standard_deviation_sigma_times_c():
    # 20000 coordinates: the sample sd of N(0, s²) is within 2% of s with probability > 1 - 1e-9.
    got, _ = noisy_clipped_sum([], [(20000,)], clip=2.0, sigma=0.7, source=make_source(False, 5))
    assert float(np.std(got[0])) == pytest.approx(1.4, rel=0.02)
    assert abs(float(np.mean(got[0]))) < 0.05
