"""Accounting of synthetic-data mechanisms: each event against its closed form, a whole run by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from veil.accounting.events import ExponentialMechanism, Gaussian, event_from_json
from veil.accounting.pld import PLDAccountant
from veil.accounting.rdp import DEFAULT_ORDERS, RDPAccountant, exponential_mechanism_rdp
from veil.accounting.zcdp import epsilon_of_rho, rho_for_epsilon
from veil.errors import InvalidParameterError, UnsupportedEventError
from veil.mechanisms.exponential import FLOAT_SCORE_SLACK, exponential_mechanism
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.synth.measure import Spend, event_rho, measure

dp_accounting = pytest.importorskip("dp_accounting")


def _reference_epsilon(rho: float, delta: float) -> float:
    """dp-accounting's RDP accountant on one zCDP event of ρ (its own orders and conversion)."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.ZCDpEvent(rho))
    return float(acc.get_epsilon(delta))


def test_exponential_mechanism_event_is_eps_squared_over_8_zcdp_capped_by_pure_eps() -> None:
    for eps in (0.01, 0.3, 2.0):
        e = ExponentialMechanism(eps)
        assert e.rho == pytest.approx(eps**2 / 8, rel=1e-15)
        curve = exponential_mechanism_rdp(eps, DEFAULT_ORDERS)
        closed = [min(a * eps * eps / 8, eps) for a in DEFAULT_ORDERS]
        np.testing.assert_allclose(curve, closed, rtol=1e-15)
        acc = RDPAccountant().compose(e)
        np.testing.assert_allclose(acc.rdp, closed, rtol=1e-15)
        assert event_from_json(e.to_json()) == e


def test_exponential_mechanism_event_validates_and_pld_refuses_it() -> None:
    with pytest.raises(InvalidParameterError):
        ExponentialMechanism(0.0)
    with pytest.raises(UnsupportedEventError):
        PLDAccountant().compose(ExponentialMechanism(1.0))


def test_gaussian_measurement_event_is_its_noise_multiplier_at_sensitivity_one() -> None:
    codes = np.array([[0, 1], [1, 1], [2, 0]])
    spend = Spend(1.0)
    m = measure(codes, (3, 2), (0, 1), 7.5, SeededSource(0), spend, ["a", "b"])
    label, event = spend.events[0]
    assert event == Gaussian(7.5) and label == "measure a × b" and m.sigma == 7.5
    assert event_rho(event) == pytest.approx(1 / (2 * 7.5**2), rel=1e-15)
    # Secure mode: lattice-corrected event, never below the planned multiplier.
    spend = Spend(1.0)
    measure(codes, (3, 2), (0, 1), 7.5, SecureSource(), spend, ["a", "b"])
    got = spend.events[0][1]
    assert isinstance(got, Gaussian) and 7.5 <= got.noise_multiplier < 7.5 * (1 + 1e-6)


def test_rho_for_epsilon_inverts_the_conversion_and_matches_dp_accounting() -> None:
    for eps, delta in ((1.0, 1e-6), (3.0, 1e-9), (0.2, 1e-5)):
        rho = rho_for_epsilon(eps, delta)
        assert epsilon_of_rho(rho, delta) <= eps
        assert epsilon_of_rho(rho * (1 + 1e-6), delta) > eps * (1 - 1e-5)
        # Never looser than the classic ρ + 2√(ρ log 1/δ), and close to dp-accounting's conversion.
        assert eps <= rho + 2 * math.sqrt(rho * math.log(1 / delta)) + 1e-12
        assert _reference_epsilon(rho, delta) == pytest.approx(eps, rel=2e-2)


def test_exponential_mechanism_sampler_matches_its_distribution() -> None:
    """Seeded χ² test over 4000 draws; false-failure rate 1e-4 (threshold of χ²₂ at 1 − 1e-4)."""
    scores = np.array([0.0, 1.0, 3.0])
    eps, sens = 1.5, 1.0
    rng = SeededSource(2024)
    draws = np.bincount([exponential_mechanism(scores, eps, sens, rng)[0] for _ in range(4000)], minlength=3)
    w = np.exp(eps * scores / (2 * (sens + FLOAT_SCORE_SLACK)))
    expected = 4000 * w / w.sum()
    chi2 = float(np.sum((draws - expected) ** 2 / expected))
    assert chi2 < 18.42


def test_a_whole_mst_run_composes_to_the_hand_composed_reference() -> None:
    from veil.synth.mechanisms import mst

    rng0 = np.random.default_rng(0)
    d, sizes = 4, (3, 2, 4, 2)
    codes = np.stack([rng0.integers(0, s, 400) for s in sizes], axis=1)
    eps, delta = 2.0, 1e-6
    rho = rho_for_epsilon(eps, delta)
    fit = mst(codes, sizes, rho, SeededSource(1), list("abcd"), rows=50, iterations=20)
    kinds = [e.kind for _, e in fit.spend.events]
    assert kinds == ["gaussian"] * d + ["exponential_mechanism"] * (d - 1) + ["gaussian"] * (d - 1)
    # By hand: ρ/3 over d 1-way marginals, ρ/3 over d − 1 selections (ε²/8 each), ρ/3 over d − 1 pairs.
    sigma1, sigma2 = math.sqrt(3 * d / (2 * rho)), math.sqrt(3 * (d - 1) / (2 * rho))
    eps_sel = math.sqrt(8 * (rho / 3) / (d - 1))
    hand = d / (2 * sigma1**2) + (d - 1) * eps_sel**2 / 8 + (d - 1) / (2 * sigma2**2)
    assert hand == pytest.approx(rho, rel=1e-12)
    assert fit.spend.rho == pytest.approx(hand, rel=1e-12)
    acc = RDPAccountant()
    for _, e in fit.spend.events:
        acc.compose(e)
    spent = acc.epsilon(delta)
    assert spent <= eps * (1 + 1e-12)
    assert spent == pytest.approx(_reference_epsilon(hand, delta), rel=2e-2)
    assert spent == pytest.approx(eps, rel=1e-6)


def test_a_whole_aim_run_follows_its_schedule_and_composes_to_the_hand_composed_reference() -> None:
    from veil.synth.mechanisms import aim, workload_cliques

    rng0 = np.random.default_rng(3)
    d, sizes = 4, (3, 2, 4, 2)
    codes = np.stack([rng0.integers(0, s, 500) for s in sizes], axis=1)
    codes[:, 1] = (codes[:, 0] + codes[:, 2]) % 2  # a dependence worth selecting
    eps, delta = 3.0, 1e-6
    rho = rho_for_epsilon(eps, delta)
    work = workload_cliques(d, 2)
    fit = aim(codes, sizes, rho, SeededSource(2), list("abcd"), rows=50,
              workload=work, max_cells=10_000, iterations=20, round_iterations=10)  # fmt: skip
    events = [e for _, e in fit.spend.events]
    # By hand (McKenna et al. 2022, T = 16d rounds, α = 0.9): σ₀ = √(T/(2αρ)), ε₀ = √(8(1−α)ρ/T); the
    # d 1-way marginals at σ₀; each round one selection then one measurement, σ halved and ε doubled
    # together (σ·ε constant) until the last round, which takes what is left: σ = √(1/(2α·rest)),
    # ε = √(8(1−α)·rest).
    sigma0, eps0 = math.sqrt(16 * d / (2 * 0.9 * rho)), math.sqrt(8 * 0.1 * rho / (16 * d))
    assert all(isinstance(e, Gaussian) and e.noise_multiplier == pytest.approx(sigma0) for e in events[:d])
    rounds = list(zip(events[d::2], events[d + 1 :: 2], strict=True))
    assert len(events) == d + 2 * len(rounds) and len(rounds) >= 2
    used = d / (2 * sigma0**2)
    for k, (sel, mea) in enumerate(rounds):
        assert isinstance(sel, ExponentialMechanism) and isinstance(mea, Gaussian)
        if k < len(rounds) - 1:
            halvings = math.log2(sigma0 / mea.noise_multiplier)
            assert halvings == pytest.approx(round(halvings), abs=1e-9)
            assert sel.epsilon == pytest.approx(eps0 * 2 ** round(halvings), rel=1e-12)
        else:
            rest = rho - used
            assert mea.noise_multiplier == pytest.approx(math.sqrt(1 / (2 * 0.9 * rest)), rel=1e-8)
            assert sel.epsilon == pytest.approx(math.sqrt(8 * 0.1 * rest), rel=1e-8)
        used += sel.epsilon**2 / 8 + 1 / (2 * mea.noise_multiplier**2)
    assert used == pytest.approx(rho, rel=1e-7) and used <= rho
    assert fit.spend.rho == pytest.approx(used, rel=1e-12)
    acc = RDPAccountant()
    for e in events:
        acc.compose(e)
    spent = acc.epsilon(delta)
    assert spent <= eps * (1 + 1e-12)
    assert spent == pytest.approx(_reference_epsilon(used, delta), rel=2e-2)


def test_the_row_count_is_the_inverse_variance_average_of_every_measurement() -> None:
    from veil.synth.mechanisms import _total
    from veil.synth.pgm import Measurement

    one = Measurement((0,), np.array([40.0, 70.0]), np.full(2, 1 / 25.0), 5.0)  # sum 110, var 2·25
    two = Measurement((0, 1), np.full((2, 3), 16.0), np.full((2, 3), 1 / 4.0), 2.0)  # sum 96, var 6·4
    hand = (110 / 50 + 96 / 24) / (1 / 50 + 1 / 24)
    assert _total([one, two]) == pytest.approx(hand, rel=1e-12)
    assert _total([Measurement((0,), np.array([-9.0, 2.0]), np.ones(2), 1.0)]) == 1.0  # at least one row
