"""PATE privacy analysis against independent references.

* Prop. 7 and Theorem 6 (data-dependent GNMax/threshold bounds) against the *exact* output
  distributions of the mechanisms, computed by 1-D quadrature, and the exact Rényi divergence to
  every neighbouring histogram (a naive loop over neighbours).
* Smooth sensitivity: the local-sensitivity bounds against an exhaustive search over all vote
  histograms within distance k (small K), and the β-smoothness property on every neighbour pair.
* The GNSS release's RDP against numerical integration of the Gaussian Rényi divergence.
* Aggregator noise: seeded chi-square / binomial tests of the noisy-max distribution against the
  exact one, each with a wrong scale that must be rejected. Seeded, α = 1e-3: a correct sampler
  fails for at most 1 seed in 1000, and the seeds are fixed, so the outcome is deterministic.
* Budgets: answers stop where ε would pass the target; never optimistic against dp-accounting.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, stats
from scipy.special import log_ndtr, logsumexp

from veil.errors import ConfigError, UnreachableTargetError
from veil.mechanisms import SeededSource
from veil.pate.aggregators import Aggregator, answer_query
from veil.pate.analysis import (
    data_dependent_rdp,
    data_independent_rdp,
    log_q_noisy_max,
    log_q_threshold,
)
from veil.pate.label_settings import LabelSettings
from veil.pate.labelling import label_queries, plan_budget
from veil.pate.smooth_sensitivity import (
    DataDependentAccount,
    GnmaxSensitivity,
    ReleaseParams,
    gnss_rdp,
    smooth_sensitivity,
    threshold_local_sensitivity,
)

SQRT2 = math.sqrt(2.0)


# -- exact references ------------------------------------------------------------------------------
def exact_log_probs(counts: list[int], sigma: float, points: int = 6001) -> np.ndarray:
    """log Pr[argmax_j(n_j + N(0, σ²)) = i] by quadrature over the noise of class i."""
    c = np.asarray(counts, dtype=float)
    x = np.linspace(-14.0, 14.0, points) * sigma
    log_phi = -0.5 * (x / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))
    out = []
    for i in range(len(c)):
        s = log_phi.copy()
        for j in range(len(c)):
            if j != i:
                s = s + log_ndtr((c[i] + x - c[j]) / sigma)
        out.append(float(logsumexp(s)) + math.log(x[1] - x[0]))
    return np.array(out)


def renyi(log_p: np.ndarray, log_q: np.ndarray, lam: float) -> float:
    return float(logsumexp(lam * log_p + (1 - lam) * log_q)) / (lam - 1)


def neighbours(counts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Histograms after one teacher changes its vote."""
    out = []
    for a, b in itertools.permutations(range(len(counts)), 2):
        if counts[a] > 0:
            d = list(counts)
            d[a] -= 1
            d[b] += 1
            out.append(tuple(d))
    return out


def all_histograms(k: int, c: int) -> list[tuple[int, ...]]:
    return [
        tuple(np.diff([0, *cuts, k + c - 1]) - 1) for cuts in itertools.combinations(range(1, k + c), c - 1)
    ]


# -- Prop. 7 and Theorem 6 -------------------------------------------------------------------------
def test_prop7_bounds_the_exact_error_probability_and_is_close() -> None:
    # Monte Carlo cross-check of the quadrature itself (200k draws; tolerance 5 standard errors).
    rng = np.random.default_rng(1)
    counts, sigma = [7, 3, 0], 2.0
    noisy = np.asarray(counts) + sigma * rng.standard_normal((200_000, 3))
    mc = float(np.mean(np.argmax(noisy, axis=1) != 0))
    exact = -math.expm1(exact_log_probs(counts, sigma)[0])
    assert abs(mc - exact) < 5 * math.sqrt(exact * (1 - exact) / 200_000)
    for counts, sigma in [
        ([10, 0, 0], 2.0),
        ([9, 1, 0], 2.0),
        ([25, 3, 2], 5.0),
        ([6, 4, 0], 1.0),
        ([40, 0, 0], 6.0),
    ]:
        q_exact = -math.expm1(exact_log_probs(counts, sigma)[int(np.argmax(counts))])
        q_bound = math.exp(float(log_q_noisy_max(counts, sigma)))
        assert q_exact <= q_bound * (1 + 1e-9)
        assert q_bound <= 1.1 * q_exact  # the union bound is tight when one rival dominates


@pytest.mark.parametrize(
    ("counts", "sigma"),
    [
        ((10, 0, 0), 2.0),
        ((9, 1, 0), 2.0),
        ((18, 2, 0), 4.0),
        ((25, 3, 2), 5.0),
        ((8, 2, 0), 1.5),
        ((40, 0, 0), 6.0),
    ],
)
def test_theorem6_bounds_the_exact_renyi_divergence_to_every_neighbour(
    counts: tuple[int, ...], sigma: float
) -> None:
    log_p = exact_log_probs(list(counts), sigma)
    others = [exact_log_probs(list(n), sigma) for n in neighbours(counts)]
    log_q = float(log_q_noisy_max(counts, sigma))
    for lam in (1.5, 2.0, 3.0, 5.0, 8.0):
        bound = float(data_dependent_rdp(log_q, sigma / SQRT2, lam))
        exact = max(renyi(log_p, lq, lam) for lq in others)
        assert exact <= bound * (1 + 1e-6) + 1e-12, (lam, exact, bound)
        assert bound <= lam / sigma**2 * (1 + 1e-9)


def test_data_dependent_never_above_data_independent_and_vanishes_for_unanimous_votes() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        k, c = int(rng.integers(2, 300)), int(rng.integers(2, 12))
        counts = rng.multinomial(k, rng.dirichlet(np.full(c, 0.3)))
        sigma, lam = float(rng.uniform(0.5, 60)), float(rng.uniform(1.1, 60))
        dd = float(data_dependent_rdp(log_q_noisy_max(counts, sigma), sigma / SQRT2, lam))
        assert 0.0 <= dd <= lam / sigma**2 * (1 + 1e-9)
    # Unanimous: paper-sized ensemble (250 teachers, σ = 40) and a confident one (σ = 10, 100 teachers).
    unanimous = [250] + [0] * 9
    di = float(data_independent_rdp(40 / SQRT2, 8.0))
    assert float(data_dependent_rdp(log_q_noisy_max(unanimous, 40.0), 40 / SQRT2, 8.0)) < 0.05 * di
    assert float(data_dependent_rdp(log_q_noisy_max([100] + [0] * 9, 10.0), 10 / SQRT2, 8.0)) < 1e-8
    # Adversarial (a tie, a near tie): nothing to gain, the data-independent bound is returned.
    for counts in ([5, 5, 0], [126, 124] + [0] * 8):
        sigma = 1.0 if sum(counts) == 10 else 40.0
        for lam in (2.0, 10.0):
            got = float(data_dependent_rdp(log_q_noisy_max(counts, sigma), sigma / SQRT2, lam))
            assert got == pytest.approx(lam / sigma**2)


def test_data_dependent_bound_is_non_decreasing_in_q() -> None:
    log_q = -np.geomspace(1e4, 1e-9, 4000)
    for z, lam in [(40 / SQRT2, 8.0), (1.0, 2.0), (150.0, 20.0), (3.0, 1.5), (20.0, 60.0)]:
        f = data_dependent_rdp(log_q, z, lam)
        assert np.all(np.diff(f) >= -1e-12 * np.abs(f[1:])), (z, lam)
        assert f[-1] <= lam / (2 * z * z) * (1 + 1e-12)


def test_each_theorem6_candidate_is_non_decreasing_where_it_is_used() -> None:
    """Using q̃ ≥ q needs each candidate bound non-decreasing on (0, q̃]; its validity set is an interval."""
    from veil.pate.analysis import _theorem6_candidates

    log_q = -np.geomspace(1e4, 1e-9, 3000)  # increasing q
    for z, lam in [(40 / SQRT2, 8.0), (150.0, 20.0), (3.0, 1.5), (1.0, 2.0), (5.0, 30.0)]:
        _, bound, valid = _theorem6_candidates(log_q, 2 * z * z, lam)
        for j in range(bound.shape[1]):
            ok = valid[:, j]
            if not ok.any():
                continue
            last = int(np.flatnonzero(ok)[-1])
            assert ok[: last + 1].all()  # downward closed in q
            col = bound[: last + 1, j]
            assert np.all(np.diff(col) >= -1e-9 * np.abs(col[1:])), (z, lam, j)


def test_threshold_check_bound_matches_closed_form_and_exact_divergence() -> None:
    t, sigma1 = 30.0, 6.0
    for m in (10, 25, 30, 38, 50):
        log_q, log_p = log_q_threshold(float(m), t, sigma1)
        p = stats.norm.sf(t - m, scale=sigma1)
        assert math.exp(float(log_p)) == pytest.approx(p, rel=1e-12)
        assert math.exp(float(log_q)) == pytest.approx(min(p, 1 - p), rel=1e-9)
        for lam in (1.5, 3.0, 8.0):
            bound = float(data_dependent_rdp(log_q, sigma1, lam))
            assert bound <= lam / (2 * sigma1**2) * (1 + 1e-9)
            for m2 in (m - 1, m + 1):  # the bit "answered" on the neighbours
                p2 = stats.norm.sf(t - m2, scale=sigma1)
                exact = renyi(np.log([p, 1 - p]), np.log([p2, 1 - p2]), lam)
                assert exact <= bound * (1 + 1e-6) + 1e-15


# -- smooth sensitivity ----------------------------------------------------------------------------
def _f_gnmax(h: tuple[int, ...], sigma: float, lam: float) -> float:
    return float(data_dependent_rdp(log_q_noisy_max(h, sigma), sigma / SQRT2, lam))


@pytest.mark.parametrize(("k", "c", "sigma", "lam"), [(8, 3, 1.5, 2.0), (12, 4, 2.0, 3.0), (10, 3, 1.0, 1.5)])
def test_gnmax_local_sensitivity_bounds_an_exhaustive_search(
    k: int, c: int, sigma: float, lam: float
) -> None:
    hs = all_histograms(k, c)
    f = {h: _f_gnmax(h, sigma, lam) for h in hs}
    ls = {h: max(abs(f[n] - f[h]) for n in neighbours(h)) for h in hs}  # exact local sensitivity
    ls_arr = np.array([ls[h] for h in hs])
    dist = np.abs(np.array(hs)[:, None, :] - np.array(hs)[None, :, :]).sum(axis=2) // 2
    table = GnmaxSensitivity(sigma, sigma / SQRT2, lam, c, k)
    bounds = {h: table.local(np.array(h)) for h in hs}
    for i, h in enumerate(hs):
        a = bounds[h]
        for d in range(k + 1):
            ball = float(ls_arr[dist[i] <= d].max())  # the worst local sensitivity within distance d
            assert ball <= a[d] * (1 + 1e-9) + 1e-300, (h, d, ball, a[d])
        for n in neighbours(h):  # nested: A^(d)(h) ≤ A^(d+1)(h') for every neighbour h'
            assert np.all(a[:-1] <= bounds[n][1:] * (1 + 1e-12))
    # not vacuous: at distance 0 within a factor 25 of the true local sensitivity somewhere steep
    steep = max(hs, key=lambda h: ls[h])
    assert bounds[steep][0] <= 25 * ls[steep]


def test_threshold_local_sensitivity_bounds_an_exhaustive_search() -> None:
    k, t, sigma1, lam = 20, 12.0, 3.0, 3.0
    f = data_dependent_rdp(log_q_threshold(np.arange(k + 1), t, sigma1)[0], sigma1, lam)
    ls = [max(abs(f[m] - f[j]) for j in (m - 1, m + 1) if 0 <= j <= k) for m in range(k + 1)]
    a = threshold_local_sensitivity(np.arange(k + 1), k, t, sigma1, sigma1, lam)
    for m in range(k + 1):
        for d in range(k + 1):
            assert max(ls[max(0, m - d) : m + d + 1]) <= a[m, d] * (1 + 1e-9)
        for m2 in (m - 1, m + 1):
            if 0 <= m2 <= k:
                assert np.all(a[m, :-1] <= a[m2, 1:] * (1 + 1e-12))


def test_smooth_sensitivity_is_beta_smooth_over_many_queries() -> None:
    rng = np.random.default_rng(3)
    k, c, sigma, beta = 30, 5, 3.0, 0.2
    params = ReleaseParams(order=3.0, beta=beta, sigma_s=5.0)
    for _ in range(5):
        base = [rng.multinomial(k, rng.dirichlet(np.full(c, 0.5))) for _ in range(12)]
        moved = []
        for h in base:  # one teacher changes its vote on every query
            h2 = h.copy()
            a = int(rng.choice(np.flatnonzero(h2)))
            h2[a] -= 1
            h2[int(rng.integers(c))] += 1
            moved.append(h2)
        s = []
        for hs in (base, moved):
            acc = DataDependentAccount(k, c, params)
            for h in hs:
                acc.add_gnmax(h, sigma, sigma / SQRT2)
                acc.add_threshold(int(h.max()), 18.0, 4.0, 4.0)
            s.append(acc.smooth_sensitivity())
            # the smooth bound dominates the local sensitivity of the sum at this vote set
        assert s[0] <= math.exp(beta) * s[1] * (1 + 1e-9) and s[1] <= math.exp(beta) * s[0] * (1 + 1e-9)
    assert smooth_sensitivity(np.array([0.0, 1.0, 2.0]), 1.0) == pytest.approx(
        max(math.exp(-1), 2 * math.exp(-2))
    )


def _gauss_renyi_numeric(mu: float, s0: float, s1: float, alpha: float) -> float:
    """D_α(N(0, s0²) ‖ N(mu, s1²)) by quadrature."""

    def integrand(x: float) -> float:
        lp = stats.norm.logpdf(x, 0, s0)
        lq = stats.norm.logpdf(x, mu, s1)
        return math.exp(alpha * lp + (1 - alpha) * lq)

    width = 40 * max(s0, s1) + abs(mu)
    val, _ = integrate.quad(integrand, -width, width, limit=400, points=[0.0, mu])
    return math.log(val) / (alpha - 1)


def test_gnss_rdp_bounds_the_numerical_divergence_and_is_attained() -> None:
    for beta, sigma_s, alpha in [(0.05, 4.0, 5.0), (0.02, 8.0, 12.0), (0.2, 3.0, 2.0)]:
        bound = float(gnss_rdp(alpha, beta, sigma_s)[0])
        worst = 0.0
        for r in np.exp(np.linspace(-beta, beta, 9)):
            for shift in (0.0, min(1.0, r)):  # |Δ| ≤ min(S(D), S(D')), in units of S(D)
                for s0, s1, mu in ((sigma_s, sigma_s * r, shift), (sigma_s * r, sigma_s, shift / r * r)):
                    worst = max(worst, _gauss_renyi_numeric(mu, s0, s1, alpha))
        assert worst <= bound * (1 + 1e-6)
        assert worst >= 0.97 * bound  # the closed form is (nearly) attained: not vacuous
    assert np.isinf(gnss_rdp(30.0, 0.1, 5.0)[0])  # (α−1)(e^{2β}−1) ≥ 1: no bound


def test_release_exceeds_the_true_value_with_the_stated_confidence() -> None:
    params = ReleaseParams(order=4.0, beta=0.05, sigma_s=3.0, confidence=0.9)
    acc = DataDependentAccount(20, 4, params)
    for h in ([12, 5, 2, 1], [20, 0, 0, 0], [9, 9, 2, 0]):
        acc.add_gnmax(np.array(h), 2.0, 2.0 / SQRT2)
    rng = SeededSource(11)
    n = 4000
    above = sum(acc.release(rng) >= acc.value for _ in range(n))
    assert stats.binomtest(above, n, 0.9).pvalue > 1e-3  # seeded, α = 1e-3
    with pytest.raises(Exception, match="confidence"):
        ReleaseParams(order=4.0, beta=0.05, sigma_s=3.0, confidence=0.3)


# -- aggregator noise ------------------------------------------------------------------------------
def _laplace_log_probs(counts: list[int], b: float, points: int = 40001) -> np.ndarray:
    c = np.asarray(counts, dtype=float)
    x = np.linspace(-40 * b, 40 * b, points)
    out = []
    for i in range(len(c)):
        s = stats.laplace.logpdf(x, scale=b)
        for j in range(len(c)):
            if j != i:
                s = s + stats.laplace.logcdf(c[i] + x - c[j], scale=b)
        out.append(float(logsumexp(s)) + math.log(x[1] - x[0]))
    return np.array(out)


def _chi2_pvalue(samples: list[int], probs: np.ndarray) -> float:
    obs = np.bincount(samples, minlength=len(probs))
    return float(stats.chisquare(obs, probs / probs.sum() * len(samples)).pvalue)


def test_gnmax_and_lnmax_noise_follow_the_exact_noisy_max_distribution() -> None:
    counts = [6, 4, 3, 0]
    n = 20_000
    rng = SeededSource(5)
    g = [answer_query(Aggregator("gnmax", 2.0), np.array(counts), rng).label for _ in range(n)]
    assert _chi2_pvalue(g, np.exp(exact_log_probs(counts, 2.0))) > 1e-3  # type: ignore[arg-type]
    assert _chi2_pvalue(g, np.exp(exact_log_probs(counts, 3.0))) < 1e-3  # type: ignore[arg-type]
    lap = [answer_query(Aggregator("lnmax", 1.5), np.array(counts), rng).label for _ in range(n)]
    assert _chi2_pvalue(lap, np.exp(_laplace_log_probs(counts, 1.5))) > 1e-3  # type: ignore[arg-type]
    assert _chi2_pvalue(lap, np.exp(_laplace_log_probs(counts, 2.25))) < 1e-3  # type: ignore[arg-type]


def test_confident_gnmax_answers_with_the_threshold_probability() -> None:
    agg = Aggregator("confident-gnmax", 2.0, threshold=8.0, sigma1=3.0)
    rng = SeededSource(7)
    counts = np.array([7, 2, 1])
    n = 10_000
    answered = sum(answer_query(agg, counts, rng).label is not None for _ in range(n))
    p_true = stats.norm.sf(8.0 - 7, scale=3.0)
    assert stats.binomtest(answered, n, p_true).pvalue > 1e-3
    assert stats.binomtest(answered, n, stats.norm.sf(8.0 - 7, scale=4.5)).pvalue < 1e-3
    ans = answer_query(agg, counts, rng)
    assert len(ans.events) == (2 if ans.label is not None else 1)


def test_unknown_aggregator_and_stray_threshold_are_refused() -> None:
    with pytest.raises(Exception, match="aggregator"):
        Aggregator("majority", 1.0)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="threshold"):
        Aggregator("gnmax", 1.0, threshold=5.0)


# -- budgets ---------------------------------------------------------------------------------------
def _histograms(k: int, c: int, n: int, acc: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, c), dtype=np.int64)
    for q in range(n):
        y = int(rng.integers(c))
        votes = np.where(rng.random(k) < acc, y, rng.integers(c, size=k))
        out[q] = np.bincount(votes, minlength=c)
    return out


def test_gnmax_budget_stops_at_the_target_and_is_never_optimistic() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    hist = _histograms(100, 10, 400, 0.8, 0)
    s = LabelSettings(Aggregator("gnmax", 20.0), 2.0, 1e-5, 400, 100, 10, data_dependent=False)
    res = label_queries(hist, s, SeededSource(0))
    n = res.queries_answered
    assert 0 < n < 400 and res.stop_reason == "budget spent"
    assert res.epsilon_data_independent <= 2.0
    more = LabelSettings(Aggregator("gnmax", 20.0), 2.0, 1e-5, n + 1, 100, 10, data_dependent=False)
    assert plan_budget(more, secure=False).max_answers == n  # n + 1 would pass the target
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(20.0 / SQRT2), n)
    tight = pld.get_epsilon(1e-5)
    assert tight <= res.epsilon_data_independent <= 1.2 * tight


def test_confident_gnmax_filter_keeps_every_path_within_the_budget() -> None:
    hist = _histograms(100, 10, 800, 0.7, 1)
    agg = Aggregator("confident-gnmax", 10.0, threshold=70.0, sigma1=40.0)
    params = ReleaseParams(order=10.0, beta=0.02, sigma_s=8.0)
    s = LabelSettings(agg, 1.5, 1e-5, 800, 100, 10, release=params)
    res = label_queries(hist, s, SeededSource(3))
    plan = plan_budget(s, secure=False)
    spent = res.queries_asked * plan.rho_threshold + res.queries_answered * plan.rho_answer
    assert spent <= plan.rho_max
    assert res.queries_answered < res.queries_asked
    assert res.epsilon_data_independent <= 1.5 + 1e-9
    assert res.epsilon_data_dependent is not None and res.releases == 1
    assert np.all((res.labels >= -1) & (res.labels < 10))


def test_data_dependent_budget_releases_periodically_and_states_the_worst_case() -> None:
    hist = _histograms(100, 10, 300, 0.9, 2)
    params = ReleaseParams(order=8.0, beta=0.03, sigma_s=8.0, confidence=0.5)
    s = LabelSettings(
        Aggregator("gnmax", 12.0),
        2.0,
        1e-5,
        300,
        100,
        10,
        budget="data-dependent",
        release=params,
        check_every=40,
    )
    res = label_queries(hist, s, SeededSource(4))
    # The data-dependent budget decides when to stop; the guarantee stays the data-independent ε.
    assert res.guarantee == "data-dependent" and res.epsilon == res.epsilon_data_independent
    assert res.releases == len(res.released_curve) >= 2
    # The worst case over all 300 queries is far above the target; the released ε is capped by it.
    assert res.epsilon_data_independent > s.epsilon
    assert res.epsilon_data_dependent is not None
    assert res.epsilon_data_dependent <= res.epsilon_data_independent
    with pytest.raises(ConfigError):
        LabelSettings(Aggregator("lnmax", 5.0), 2.0, 1e-5, 10, 10, 10, budget="data-dependent")


def test_epsilon_too_small_for_one_query_is_refused_before_any_answer() -> None:
    for agg in (
        Aggregator("gnmax", 1.0),
        Aggregator("lnmax", 0.5),
        Aggregator("confident-gnmax", 1.0, 5.0, 1.0),
    ):
        s = LabelSettings(agg, 0.05, 1e-5, 10, 10, 3, data_dependent=False)
        with pytest.raises(UnreachableTargetError, match="even one query"):
            plan_budget(s, secure=False)
