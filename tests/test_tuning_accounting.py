"""Papernot–Steinke tuning accounting against an independent implementation and direct computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize

from veil.accounting.events import Gaussian, PoissonSampled, SelfComposed
from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_delta, rdp_to_epsilon
from veil.accounting.tuning import TrialCount, trial_rdp, tuning_epsilon, tuning_rdp

ORDERS = [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0]


def _reference_rdp(sigma: float, q: float, steps: int, mean: float, shape: float) -> np.ndarray:
    """dp-accounting's RepeatAndSelectDpEvent over the same trial, at the same orders."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    trial = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps
    )
    acc = RdpAccountant(orders=ORDERS)
    acc.compose(dp_event.RepeatAndSelectDpEvent(trial, mean, shape))
    return np.asarray(acc._rdp)


@pytest.mark.parametrize(
    ("law", "shape", "mean"),
    [
        ("negative_binomial", 0.0, 5.0),
        ("negative_binomial", 0.0, 1.5),  # the automatic plan's menu (veil.tune.plan): η = 0
        ("negative_binomial", 0.0, 2.0),
        ("negative_binomial", 0.0, 6.0),
        ("negative_binomial", 1.0, 3.0),
        ("negative_binomial", 0.5, 10.0),
        ("poisson", math.inf, 4.0),
    ],
)
def test_matches_dp_accounting(law: str, shape: float, mean: float) -> None:
    sigma, q, steps = 1.1, 0.05, 60
    trial = [SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)]
    count = TrialCount(mean, law, shape if law != "poisson" else 1.0)  # type: ignore[arg-type]
    ours = tuning_rdp(ORDERS, trial_rdp(trial, ORDERS), count)
    ref = _reference_rdp(sigma, q, steps, mean, shape)
    # dp-accounting lowers each order to a higher order's bound (RDP is monotone in λ) only for the
    # negative binomial; the same step is valid for Poisson, so the reference is compared after it.
    np.testing.assert_allclose(ours, np.minimum.accumulate(ref[::-1])[::-1], rtol=1e-6)


def test_negative_binomial_against_a_numeric_evaluation_of_theorem_2() -> None:
    """For a Gaussian trial (RDP α/2σ²) the formula is minimised over a continuous λ̂ numerically."""
    sigma, eta, mean, delta = 3.0, 1.0, 4.0, 1e-5
    count = TrialCount(mean, "negative_binomial", eta)
    gamma = count.gamma
    # The pmf is a law with the stated mean (direct sums).
    ks = np.arange(1, 2000)
    p = np.array([count.pmf(int(k)) for k in ks])
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert (ks * p).sum() == pytest.approx(mean, rel=1e-9)

    def rdp(a: float) -> float:
        return a / (2 * sigma**2)

    res = optimize.minimize_scalar(
        lambda lh: (1 - 1 / lh) * rdp(lh) + math.log(1 / gamma) / lh, bounds=(1.0, 1e4), method="bounded"
    )
    const = (1 + eta) * res.fun
    lams = np.linspace(1.01, 200, 20000)
    direct = min(
        rdp_to_epsilon([lam], [rdp(lam) + const + math.log(mean) / (lam - 1)], delta) for lam in lams[::50]
    )
    ours = tuning_epsilon([Gaussian(sigma)], delta, count)
    # Ours uses a discrete grid of orders: never below the continuous optimum, and close to it.
    assert direct - 1e-9 <= ours <= direct * 1.03


def test_poisson_closed_form_for_a_gaussian_trial() -> None:
    """Theorem 6 evaluated directly: δ̂ of the Gaussian at ε̂ from its exact (ε, δ) curve is ≤ the RDP one."""
    from scipy.stats import norm

    sigma, mu, delta = 4.0, 3.0, 1e-5
    count = TrialCount(mu, "poisson")
    ours = tuning_rdp(DEFAULT_ORDERS, np.asarray(DEFAULT_ORDERS) / (2 * sigma**2), count)
    gauss = np.asarray(DEFAULT_ORDERS) / (2 * sigma**2)
    closed, via_rdp = [], []
    for lam in DEFAULT_ORDERS:
        eps_hat = math.log1p(1 / (lam - 1))
        # The exact (Balle & Wang 2018) δ of the Gaussian at ε̂: a valid δ̂ too, and the smallest.
        exact = norm.cdf(1 / (2 * sigma) - eps_hat * sigma) - math.exp(eps_hat) * norm.cdf(
            -1 / (2 * sigma) - eps_hat * sigma
        )
        closed.append(lam / (2 * sigma**2) + mu * exact + math.log(mu) / (lam - 1))
        d_rdp = rdp_to_delta(DEFAULT_ORDERS, gauss, eps_hat)
        via_rdp.append(lam / (2 * sigma**2) + mu * d_rdp + math.log(mu) / (lam - 1))

    def env(x: list[float]) -> np.ndarray:
        return np.minimum.accumulate(np.asarray(x)[::-1])[::-1]

    assert np.all(ours >= env(closed) - 1e-12)  # never tighter than the exact δ̂ allows
    np.testing.assert_allclose(ours, env(via_rdp), rtol=1e-12)  # Theorem 6 with the RDP-derived δ̂
    assert tuning_epsilon([Gaussian(sigma)], delta, count) > rdp_to_epsilon(
        DEFAULT_ORDERS, np.asarray(DEFAULT_ORDERS) / (2 * sigma**2), delta
    )


def test_total_exceeds_one_trial_and_grows_with_the_mean() -> None:
    trial = [SelfComposed(PoissonSampled(0.02, Gaussian(1.0)), 200), Gaussian(20.0)]
    one = rdp_to_epsilon(DEFAULT_ORDERS, trial_rdp(trial), 1e-5)
    e3 = tuning_epsilon(trial, 1e-5, TrialCount(3.0))
    e10 = tuning_epsilon(trial, 1e-5, TrialCount(10.0))
    assert one < e3 < e10


def test_sampling_follows_the_law() -> None:
    """Seeded-free but statistical: 4000 draws; the mean within 6 standard errors (false failure < 1e-8)."""
    count = TrialCount(3.0, "negative_binomial", 1.0)
    draws = np.array([count.sample() for _ in range(4000)])
    assert draws.min() >= 1
    var = sum((k - 3.0) ** 2 * count.pmf(k) for k in range(1, 500))
    assert abs(draws.mean() - 3.0) < 6 * math.sqrt(var / 4000)


def test_bad_law_refused() -> None:
    from veil.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError):
        TrialCount(0.5, "negative_binomial")
    with pytest.raises(InvalidParameterError):
        TrialCount(3.0, "uniform")  # type: ignore[arg-type]


def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """D_α(P‖Q) of two discrete laws, directly from the definition."""
    from scipy.special import logsumexp

    return float(logsumexp(order * np.log(p) + (1 - order) * np.log(q)) / (order - 1))


def test_randomized_response_bounds_every_pure_dp_pair_and_attains_it() -> None:
    """``pure_dp_rdp(ε)`` is RR(ε)'s RDP (attained) and bounds D_α of any pair with |log P/Q| ≤ ε.

    Seeded random discrete pairs (each at its own ε, the largest log-ratio); a theorem, so no
    false-failure rate: a formula that under-states any ε-DP mechanism's divergence fails here.
    """
    from veil.accounting.tuning import pure_dp_rdp

    orders = [1.25, 1.5, 2.0, 4.0, 8.0, 32.0, 256.0]
    for eps in (0.1, 1.0, 3.0):
        p = math.exp(eps) / (1 + math.exp(eps))
        rr = [_renyi(np.array([p, 1 - p]), np.array([1 - p, p]), a) for a in orders]
        np.testing.assert_allclose(pure_dp_rdp(eps, orders), rr, rtol=1e-9)
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(2, 8))
        law_p, law_q = rng.dirichlet(np.ones(k)), rng.dirichlet(np.ones(k))
        eps = float(np.max(np.abs(np.log(law_p / law_q))))
        if eps > 30:
            continue
        bound = pure_dp_rdp(eps, orders)
        for a, b in zip(orders, bound, strict=True):
            assert _renyi(law_p, law_q, a) <= b * (1 + 1e-9) + 1e-12


def test_a_data_independent_choice_costs_at_most_its_costliest_option() -> None:
    """``OneOf``: the released (choice, output) pair's D_α, computed directly, is at most the largest
    option's D_α (how :func:`events_rdp` bounds it)."""
    rng = np.random.default_rng(11)
    for _ in range(100):
        options = [(rng.dirichlet(np.ones(4)), rng.dirichlet(np.ones(4))) for _ in range(3)]
        w = rng.dirichlet(np.ones(3))
        joint_p = np.concatenate([wi * p for wi, (p, _) in zip(w, options, strict=True)])
        joint_q = np.concatenate([wi * q for wi, (_, q) in zip(w, options, strict=True)])
        for a in (1.5, 2.0, 8.0):
            largest = max(_renyi(p, q, a) for p, q in options)
            assert _renyi(joint_p, joint_q, a) <= largest + 1e-9
