"""Mechanisms: calibration against independent references, samplers against exact distributions,
events, the secure-lattice guarantees, and report-noisy-max against closed forms.

Statistical tests: seeded ones use α = 1e-3 and a fixed seed (deterministic: a correct sampler
fails for at most 1 seed in 1000); those on a SecureSource use fresh OS randomness and α = 1e-6,
so the whole file fails spuriously with probability ≲ 2e-5 per run.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import integrate, stats
from scipy.special import log_ndtr

from veil.accounting.events import Gaussian, Laplace
from veil.errors import InvalidParameterError
from veil.mechanisms import (
    RandomSource,
    SecureSource,
    SeededSource,
    discrete_gaussian_samples,
    discrete_laplace_samples,
    dominating_laplace_epsilon,
    gaussian_delta,
    gaussian_event,
    gaussian_mechanism,
    gaussian_std_analytic,
    gaussian_std_classic,
    laplace_event,
    laplace_mechanism,
    laplace_noise,
    laplace_scale,
    lattice_spacing,
    noisy_max_event,
    report_noisy_max,
    sample_bernoulli_exp,
    sample_discrete_gaussian,
    sample_discrete_laplace,
)

ALPHA = 1e-3


def alpha(src: RandomSource) -> float:
    """α = 1e-3 for seeded draws (deterministic), 1e-6 for fresh OS randomness (CI flake budget)."""
    return 1e-6 if src.secure else ALPHA


def sources() -> list[RandomSource]:
    return [SeededSource(31337), SecureSource()]


SRC_IDS = ["seeded", "secure"]


# -- independent references -----------------------------------------------------------------------
def ref_gaussian_delta(sigma: float, eps: float, sens: float = 1.0) -> float:
    """δ(ε) of N(0, σ²) at L2 sensitivity Δ, from scipy's log-CDF (not veil's code path)."""
    a = sens / (2 * sigma) - eps * sigma / sens
    c = -sens / (2 * sigma) - eps * sigma / sens
    return math.exp(log_ndtr(a)) - math.exp(eps + log_ndtr(c))


def mp_gaussian_delta(sigma: float, eps: float, sens: float = 1.0) -> float:
    """The same δ(ε) in 50-digit arithmetic (mpmath ships with torch's sympy dependency)."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        s, e, d = mpmath.mpf(sigma), mpmath.mpf(eps), mpmath.mpf(sens)
        val = mpmath.ncdf(d / (2 * s) - e * s / d) - mpmath.exp(e) * mpmath.ncdf(-d / (2 * s) - e * s / d)
        return float(val)


def hockey_stick(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(p - math.exp(eps) * q, 0.0).sum())


def laplace_delta(shift: float, scale: float, eps: float) -> float:
    """Exact δ(ε) of continuous Laplace(scale) with shift (closed form)."""
    e = shift / scale
    if eps >= e:
        return 0.0
    if eps <= -e:
        return 1.0 - math.exp(eps)
    return 1.0 - math.exp((eps - e) / 2.0)


def chi2_fit(samples: np.ndarray, pmf_on: dict[int, float]) -> float:
    """χ² p-value of integer samples against a pmf; outer values pooled into two tail bins."""
    keys = sorted(pmf_on)
    lo, hi = keys[0], keys[-1]
    obs = (
        [int((samples < lo).sum())] + [int((samples == k).sum()) for k in keys] + [int((samples > hi).sum())]
    )
    p_in = [pmf_on[k] for k in keys]
    rest = max(0.0, 1.0 - sum(p_in))
    n = samples.size
    # Split the leftover mass between the tails by symmetry (all pmfs here are symmetric).
    exp = [rest / 2 * n] + [p * n for p in p_in] + [rest / 2 * n]
    obs_a, exp_a = np.array(obs, float), np.array(exp, float)
    exp_a *= obs_a.sum() / exp_a.sum()
    return float(stats.chisquare(obs_a, exp_a).pvalue)


def dlap_pmf(t: float, support: range) -> dict[int, float]:
    z = np.arange(-5000, 5001)
    w = np.exp(-np.abs(z) / t)
    w /= w.sum()
    return {k: float(w[k + 5000]) for k in support}


def dgauss_pmf(sigma2: float, support: range) -> dict[int, float]:
    z = np.arange(-2000, 2001)
    w = np.exp(-(z.astype(float) ** 2) / (2 * sigma2))
    w /= w.sum()
    return {k: float(w[k + 2000]) for k in support}


# -- calibration ----------------------------------------------------------------------------------
def test_laplace_scale() -> None:
    assert laplace_scale(0.5, 2.0) == 4.0
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidParameterError):
            laplace_scale(bad, 1.0)


def test_classic_gaussian_formula_and_refusal() -> None:
    sigma = gaussian_std_classic(0.5, 1e-5, 2.0)
    assert math.isclose(sigma, 2.0 * math.sqrt(2 * math.log(1.25e5)) / 0.5, rel_tol=1e-15)
    assert ref_gaussian_delta(sigma, 0.5, 2.0) <= 1e-5  # the classic bound is valid below ε = 1
    for eps in (1.0, 3.0):
        with pytest.raises(InvalidParameterError, match="ε < 1"):
            gaussian_std_classic(eps, 1e-5, 1.0)
    for bad_delta in (0.0, 1.0, -1e-5):
        with pytest.raises(InvalidParameterError):
            gaussian_std_classic(0.5, bad_delta, 1.0)


@pytest.mark.parametrize("eps", [1e-4, 0.05, 0.3, 0.9, 1.0, 2.0, 8.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-10])
@pytest.mark.parametrize("sens", [1.0, 3.7])
def test_analytic_gaussian_is_tight_and_private(eps: float, delta: float, sens: float) -> None:
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    sigma = gaussian_std_analytic(eps, delta, sens)
    # Private side: the closed-form δ(ε) at σ, in 50-digit arithmetic, is at most δ.
    assert mp_gaussian_delta(sigma, eps, sens) <= delta
    # dp-accounting (float64, its own rounding) agrees.
    dpa = GaussianPrivacyLoss(standard_deviation=sigma, sensitivity=sens).get_delta_for_epsilon(eps)
    assert dpa <= delta * (1 + 1e-6)
    # Tight: 1e-6 less noise already violates δ.
    assert mp_gaussian_delta(sigma * (1 - 1e-6), eps, sens) > delta
    assert math.isclose(gaussian_delta(sigma, eps, sens), mp_gaussian_delta(sigma, eps, sens), rel_tol=1e-10)
    if eps < 1:
        assert sigma <= gaussian_std_classic(eps, delta, sens)


# -- exact integer samplers -----------------------------------------------------------------------
@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
def test_bernoulli_exp_matches_exp_minus_gamma(src: RandomSource) -> None:
    n = 6000
    for gamma in (Fraction(1, 3), Fraction(1), Fraction(5, 2), Fraction(7, 1)):
        k = sum(sample_bernoulli_exp(gamma, src) for _ in range(n))
        assert stats.binomtest(k, n, math.exp(-gamma)).pvalue > alpha(src), gamma
    assert all(sample_bernoulli_exp(0, src) for _ in range(50))
    with pytest.raises(InvalidParameterError):
        sample_bernoulli_exp(0.5, src)  # type: ignore[arg-type]  # floats refused: not exact


@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
@pytest.mark.parametrize("t", [Fraction(5, 3), Fraction(1, 2), 4])
def test_discrete_laplace_matches_its_pmf(src: RandomSource, t: Fraction | int) -> None:
    x = discrete_laplace_samples(t, 8000, src)
    assert x.dtype == np.int64
    pmf = dlap_pmf(float(t), range(-int(3 * t) - 2, int(3 * t) + 3))
    assert chi2_fit(x, pmf) > alpha(src)
    assert isinstance(sample_discrete_laplace(t, src), int)


@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
@pytest.mark.parametrize("sigma2", [Fraction(7, 3), 20, Fraction(1, 5)])
def test_discrete_gaussian_matches_its_pmf(src: RandomSource, sigma2: Fraction | int) -> None:
    x = discrete_gaussian_samples(sigma2, 8000, src)
    s = math.sqrt(float(sigma2))
    pmf = dgauss_pmf(float(sigma2), range(-int(3 * s) - 1, int(3 * s) + 2))
    assert chi2_fit(x, pmf) > alpha(src)
    assert isinstance(sample_discrete_gaussian(sigma2, src), int)


def test_chi2_rejects_discrete_samplers_at_the_wrong_scale() -> None:
    src = SeededSource(4)
    x = discrete_laplace_samples(Fraction(5, 3) * Fraction(11, 10), 20000, src)  # t × 1.1
    assert chi2_fit(x, dlap_pmf(5 / 3, range(-7, 8))) < ALPHA
    y = discrete_gaussian_samples(Fraction(7, 3) * Fraction(121, 100), 20000, src)  # σ × 1.1
    assert chi2_fit(y, dgauss_pmf(7 / 3, range(-5, 6))) < ALPHA


def test_discrete_samplers_at_lattice_scale_match_continuous_shape() -> None:
    # The secure mechanisms run the samplers at scale ~2²⁰: check that regime too (KS vs the
    # continuous law of the rescaled draws; lattice effects are < 1e-6 in CDF).
    src = SeededSource(8)
    t = Fraction(1.7) * 2**20
    x = discrete_laplace_samples(t, 5000, src) / float(t)
    assert stats.kstest(x, "laplace").pvalue > ALPHA
    s2 = (Fraction(1.3) * 2**20) ** 2
    y = discrete_gaussian_samples(s2, 5000, src) / (1.3 * 2**20)
    assert stats.kstest(y, "norm").pvalue > ALPHA


# -- Laplace and Gaussian mechanisms --------------------------------------------------------------
@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
def test_laplace_mechanism_fits_and_reports_its_event(src: RandomSource) -> None:
    b, x0 = 2.5, 1.25
    out = laplace_mechanism(np.full(6000, x0), sensitivity=1.0, scale=b, rng=src)
    assert isinstance(out.value, np.ndarray) and out.value.shape == (6000,)
    assert stats.kstest(out.value, "laplace", args=(x0, b)).pvalue > alpha(src)
    assert isinstance(out.event, Laplace) and out.event.scale == b
    if src.secure:
        grid = out.grid
        assert grid is not None and grid == lattice_spacing(b, 6000.0)
        assert np.all(out.value / grid == np.round(out.value / grid))  # on the lattice
        assert 1.0 < out.event.sensitivity <= 1.0 + 6000 * grid * 1.001
    else:
        assert out.grid is None and out.event == Laplace(scale=b, sensitivity=1.0)
    scalar = laplace_mechanism(3.0, sensitivity=2.0, scale=1.0, rng=src)
    assert isinstance(scalar.value, float)
    assert out.event == laplace_event(1.0, b, coordinates=6000, secure=src.secure)


@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
def test_gaussian_mechanism_fits_and_reports_its_event(src: RandomSource) -> None:
    sigma, x0 = 1.7, -4.0
    out = gaussian_mechanism(np.full((60, 100), x0), sensitivity=0.5, std=sigma, rng=src)
    assert isinstance(out.value, np.ndarray) and out.value.shape == (60, 100)
    assert stats.kstest(out.value.ravel(), "norm", args=(x0, sigma)).pvalue > alpha(src)
    assert isinstance(out.event, Gaussian)
    if src.secure:
        grid = out.grid
        assert grid is not None and np.all(out.value / grid == np.round(out.value / grid))
        nm = out.event.noise_multiplier
        assert sigma / (0.5 + 3 * math.sqrt(6000) * grid) * (1 - 1e-12) <= nm < sigma / 0.5
    else:
        assert out.event == Gaussian(noise_multiplier=sigma / 0.5)
    assert out.event == gaussian_event(0.5, sigma, coordinates=6000, secure=src.secure)


def test_ks_rejects_samplers_at_1_1x_the_scale() -> None:
    # The KS tests above must have power: the same test on samples at 1.1× scale rejects.
    src = SeededSource(99)
    noise, _ = laplace_noise(1.1 * 2.5, 50000, src)
    assert stats.kstest(noise, "laplace", args=(0.0, 2.5)).pvalue < ALPHA
    z = 1.1 * src.standard_normal(50000)
    assert stats.kstest(z, "norm").pvalue < ALPHA
    # Secure path: KS distance ≈ 0.0175 at 1.1×, so √n·D ≈ 4.3 at n = 60000 (p ≈ 1e-15); the
    # chance of not rejecting at α = 1e-3 is ≈ 1e-5.
    secure_wrong = laplace_mechanism(np.zeros(60000), sensitivity=1.0, scale=1.1 * 2.5, rng=SecureSource())
    assert stats.kstest(secure_wrong.value, "laplace", args=(0.0, 2.5)).pvalue < ALPHA


def test_mechanisms_refuse_bad_inputs() -> None:
    src = SeededSource(0)
    with pytest.raises(InvalidParameterError):
        laplace_mechanism(np.nan, sensitivity=1.0, scale=1.0, rng=src)
    with pytest.raises(InvalidParameterError):
        laplace_mechanism(1.0, sensitivity=0.0, scale=1.0, rng=src)
    with pytest.raises(InvalidParameterError):
        gaussian_mechanism([1.0, np.inf], sensitivity=1.0, std=1.0, rng=src)
    with pytest.raises(InvalidParameterError):
        gaussian_mechanism(1.0, sensitivity=1.0, std=-1.0, rng=src)
    with pytest.raises(InvalidParameterError, match="RandomSource"):
        laplace_mechanism(1.0, sensitivity=1.0, scale=1.0, rng=np.random.default_rng(0))  # type: ignore[arg-type]


# -- the secure-lattice guarantees, checked against exact hockey-stick divergences ------------------
def _rounded_shift(x: float, x2: float, grid: float) -> int:
    return abs(int(np.rint(x / grid)) - int(np.rint(x2 / grid)))


@pytest.mark.parametrize("t", [0.5, 1.0, 3.0])
def test_secure_laplace_event_dominates_the_lattice_mechanism(t: float) -> None:
    """End to end at a coarse lattice (Λ = 1): the discrete release of the rounded query, for
    worst-case neighbouring inputs, is never less private than the Laplace event claims."""
    from veil.mechanisms.laplace import _secure_laplace_sensitivity

    grid, b = 1.0, t
    z = np.arange(-3000, 3001)
    p = np.exp(-np.abs(z) / t)
    p /= p.sum()
    for sens in (1.0, 2.0, 0.3):
        event_sens = _secure_laplace_sensitivity(sens, b, grid, 1)
        for x, x2 in ((0.49, 0.49 + sens), (0.5, 0.5 + sens), (-0.3, sens - 0.3)):
            m = _rounded_shift(x, x2, grid)
            q = np.roll(p, m)
            for eps in np.linspace(-3 / t - 1, 3 / t + 1, 241):
                assert hockey_stick(p, q, eps) <= laplace_delta(event_sens, b, eps) + 1e-12
    # The lattice correction is needed: without it the discrete release is worse than claimed.
    q1 = np.roll(p, 1)
    assert max(hockey_stick(p, q1, e) - laplace_delta(1.0, b, e) for e in np.linspace(-2, 2, 81)) > 1e-3


@pytest.mark.parametrize("sigma_grid", [1.0, 1.5, 4.0])
def test_secure_gaussian_event_dominates_the_lattice_mechanism(sigma_grid: float) -> None:
    from veil.mechanisms.gaussian import _secure_gaussian_sensitivity

    grid = 1.0
    z = np.arange(-400, 401)
    p = np.exp(-(z.astype(float) ** 2) / (2 * sigma_grid**2))
    p /= p.sum()
    for sens in (1.0, 2.0, 0.4):
        event_sens = _secure_gaussian_sensitivity(sens, grid, 1)
        for x, x2 in ((0.49, 0.49 + sens), (0.5, 0.5 + sens)):
            q = np.roll(p, _rounded_shift(x, x2, grid))
            for eps in np.linspace(-4, 6, 201):
                assert hockey_stick(p, q, eps) <= ref_gaussian_delta(sigma_grid, eps, event_sens) + 1e-12
    q1 = np.roll(p, 1)
    worst = max(
        hockey_stick(p, q1, e) - ref_gaussian_delta(sigma_grid, e, 1.0) for e in np.linspace(-2, 2, 81)
    )
    assert worst > 1e-4  # without the correction, the lattice release is worse than a Gaussian


def test_dominating_laplace_epsilon_covers_randomised_response() -> None:
    for eps in (0.05, 0.5, 1.0, 3.0):
        eps_l = dominating_laplace_epsilon(eps)
        assert eps < eps_l < eps + eps**2 / 4 + 1e-12
        rr = np.array([1.0, math.exp(-eps)]) / (1 + math.exp(-eps))  # RR(ε): the worst ε-DP pair
        for x in np.linspace(-eps - 0.5, eps + 0.5, 201):
            assert hockey_stick(rr, rr[::-1], x) <= laplace_delta(eps_l, 1.0, x) + 1e-13
        # and it is tight at ε' = 0: a smaller Laplace ε would not cover RR
        assert hockey_stick(rr, rr[::-1], 0.0) > laplace_delta(eps_l * (1 - 1e-6), 1.0, 0.0)


# -- report noisy max -----------------------------------------------------------------------------
def lap_diff_cdf(d: float, b: float) -> float:
    """P(L1 − L0 ≤ d) for i.i.d. Laplace(b) (closed form)."""
    if d >= 0:
        return 1.0 - 0.5 * (1 + d / (2 * b)) * math.exp(-d / b)
    return 1.0 - lap_diff_cdf(-d, b)


def exact_noisy_max_probs(counts: list[int], noise: str, scale: float) -> np.ndarray:
    """P(argmax = i) = ∫ f(v − cᵢ) Πⱼ≠ᵢ F(v − cⱼ) dv by quadrature (no Monte Carlo)."""
    dist = stats.laplace(scale=scale) if noise == "laplace" else stats.norm(scale=scale)
    edges = [-np.inf, *sorted(set(counts)), np.inf]  # split at the Laplace kinks
    probs = []
    for i, ci in enumerate(counts):

        def f(v: float, i: int = i, ci: int = ci) -> float:
            others = np.prod([dist.cdf(v - cj) for j, cj in enumerate(counts) if j != i])
            return float(dist.pdf(v - ci) * others)

        probs.append(sum(integrate.quad(f, lo, hi, limit=200)[0] for lo, hi in itertools.pairwise(edges)))
    return np.array(probs)


@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
def test_lnmax_two_counts_matches_closed_form(src: RandomSource) -> None:
    b, counts, n = 2.0, [7, 5], 3000
    wins0 = sum(report_noisy_max(counts, "laplace", b, src).index == 0 for _ in range(n))
    assert stats.binomtest(wins0, n, lap_diff_cdf(2.0, b)).pvalue > alpha(src)


@pytest.mark.parametrize("src", sources(), ids=SRC_IDS)
@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_noisy_max_three_counts_matches_exact_distribution(src: RandomSource, noise: str) -> None:
    counts, scale, n = [10, 8, 11], 2.0, 3000
    probs = exact_noisy_max_probs(counts, noise, scale)
    assert math.isclose(probs.sum(), 1.0, abs_tol=1e-6)
    idx = np.array([report_noisy_max(counts, noise, scale, src).index for _ in range(n)])  # type: ignore[arg-type]
    assert stats.chisquare(np.bincount(idx, minlength=3), probs * n).pvalue > alpha(src)


def test_noisy_max_events_cover_the_exact_two_class_release() -> None:
    # Neighbours: one teacher moves its vote from class 1 to class 0: (5, 5) → (6, 4).
    for b in (0.7, 2.0, 10.0):
        event = noisy_max_event("laplace", b, secure=False)
        assert isinstance(event, Laplace) and event.scale == b
        p = lap_diff_cdf(0.0, b)
        p2 = lap_diff_cdf(2.0, b)
        pair, pair2 = np.array([p, 1 - p]), np.array([p2, 1 - p2])
        for eps in np.linspace(-3, 3, 121):
            claim = laplace_delta(event.sensitivity, b, eps)
            assert hockey_stick(pair2, pair, eps) <= claim + 1e-13
            assert hockey_stick(pair, pair2, eps) <= claim + 1e-13
        assert event.pure_epsilon >= 2 / b  # never below the classic pure-DP cost
    for sigma in (0.8, 4.0, 40.0):
        g = noisy_max_event("gaussian", sigma, secure=False)
        assert isinstance(g, Gaussian) and math.isclose(
            g.noise_multiplier, sigma / math.sqrt(2), rel_tol=1e-12
        )
        p, p2 = 0.5, stats.norm.cdf(2 / (sigma * math.sqrt(2)))
        pair, pair2 = np.array([p, 1 - p]), np.array([p2, 1 - p2])
        for eps in np.linspace(0, 4, 81):
            assert hockey_stick(pair2, pair, eps) <= ref_gaussian_delta(g.noise_multiplier, eps) + 1e-12
        gs = noisy_max_event("gaussian", sigma, secure=True)
        assert isinstance(gs, Gaussian) and gs.noise_multiplier < g.noise_multiplier


def test_noisy_max_ties_go_to_the_smallest_index() -> None:
    class NoNoise(SeededSource):
        def uniform(self, size: int | tuple[int, ...]) -> np.ndarray:
            return np.full(size, 0.25)  # E1 = E2 → zero Laplace noise

        def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
            return np.zeros(size)

    src = NoNoise(0)
    assert report_noisy_max([3, 7, 7, 1], "laplace", 1.0, src).index == 1
    assert report_noisy_max([3, 7, 7, 1], "gaussian", 1.0, src).index == 1


def test_noisy_max_refuses_bad_inputs() -> None:
    src = SeededSource(1)
    for bad in ([1.5, 2.0], [3], [[1, 2], [3, 4]], [1, np.nan]):
        with pytest.raises(InvalidParameterError):
            report_noisy_max(bad, "laplace", 1.0, src)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        report_noisy_max([1, 2], "cauchy", 1.0, src)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        report_noisy_max([1, 2], "gaussian", 0.0, src)
