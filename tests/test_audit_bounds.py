"""The one-run ε lower bound (Steinke, Nasr & Jagielski 2023): formula, exactness and soundness.

References are independent of the code under test: binomial tails summed term by term in 60-digit
``decimal`` arithmetic (no scipy), the (ε, δ) correction maximised over *every* i in 1..m as the
theorem states, and exact false-alarm rates for randomized response. Seeded simulations state their
false-failure rates next to the thresholds.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from functools import cache

import numpy as np
import pytest
from scipy.stats import binom, norm

from veil.audit.bounds import (
    OneRunBound,
    bound_from_scores,
    default_guess_counts,
    epsilon_lower_bound,
    p_value,
)
from veil.errors import InvalidParameterError


# ---------------------------------------------------------------------------------------------
# Independent reference (stdlib only)
# ---------------------------------------------------------------------------------------------
@cache
def _pmf_table(r: int, eps: float) -> tuple[Decimal, ...]:
    with localcontext() as ctx:
        ctx.prec = 60
        e = Decimal(eps).exp()
        p = e / (1 + e)
        q = 1 - p
        return tuple(math.comb(r, k) * p**k * q ** (r - k) for k in range(r + 1))


def ref_tail(r: int, v: int, eps: float) -> Decimal:
    """P[Binomial(r, e^ε/(1+e^ε)) ≥ v], summed term by term."""
    if v <= 0:
        return Decimal(1)
    with localcontext() as ctx:
        ctx.prec = 60
        return sum(_pmf_table(r, eps)[v:], Decimal(0))


def ref_p_value(r: int, v: int, eps: float, delta: float = 0.0, m: int | None = None) -> Decimal:
    """Theorem 3.3 read literally: f(v) + 2mδ · max_{1≤i≤m} (f(v−i) − f(v)) / i."""
    with localcontext() as ctx:
        ctx.prec = 60
        f_v = ref_tail(r, v, eps)
        if delta == 0:
            return min(Decimal(1), f_v)
        assert m is not None
        alpha = max((ref_tail(r, v - i, eps) - f_v) / i for i in range(1, m + 1))
        return min(Decimal(1), f_v + 2 * m * Decimal(delta) * alpha)


CASES = [(10, 10), (37, 30), (50, 40), (100, 88), (200, 150), (1000, 600), (1000, 990)]


@pytest.mark.parametrize(("r", "v"), CASES)
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.7, 4.0])
def test_p_value_matches_term_by_term_sum(r: int, v: int, eps: float) -> None:
    got = p_value(r, v, eps)
    want = float(ref_p_value(r, v, eps))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(
    ("r", "v", "m", "delta"), [(50, 40, 50, 1e-3), (100, 88, 300, 1e-4), (200, 150, 200, 1e-5)]
)
@pytest.mark.parametrize("eps", [0.2, 1.0, 2.5])
def test_delta_p_value_matches_theorem_over_all_i(r: int, v: int, m: int, delta: float, eps: float) -> None:
    got = p_value(r, v, eps, delta=delta, m=m)
    want = float(ref_p_value(r, v, eps, delta, m))
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("r", "v"), CASES)
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_lower_bound_is_the_root_rounded_down(r: int, v: int, confidence: float) -> None:
    beta = Decimal(1) - Decimal(str(confidence))
    lb = epsilon_lower_bound(r, v, confidence)
    if lb == 0:
        assert ref_p_value(r, v, 0.0) > beta  # nothing is rejected, even ε = 0
        return
    assert ref_p_value(r, v, lb) <= beta  # the reported ε is rejected: conservative
    assert ref_p_value(r, v, lb + 2e-6) > beta  # and it is the root up to the 1e-6 rounding
    assert abs(lb * 1e6 - round(lb * 1e6)) < 1e-6


@pytest.mark.parametrize(
    ("r", "v", "m", "delta"), [(100, 95, 100, 1e-5), (200, 190, 1000, 1e-4), (60, 60, 60, 1e-3)]
)
def test_delta_lower_bound_is_the_root_rounded_down(r: int, v: int, m: int, delta: float) -> None:
    beta = Decimal("0.05")
    lb = epsilon_lower_bound(r, v, 0.95, delta=delta, m=m)
    assert lb > 0
    assert ref_p_value(r, v, lb, delta, m) <= beta
    assert ref_p_value(r, v, lb + 2e-6, delta, m) > beta
    assert lb <= epsilon_lower_bound(r, v, 0.95)  # δ > 0 can only weaken the claim


def test_known_values_from_a_brute_force_grid() -> None:
    # A grid search (step 1e-4) of the largest ε with P[Bin(r, p_ε) ≥ v] ≤ β, with scipy's binom
    # only as the tail oracle; independent of the root finder and the rounding.
    for r, v in [(100, 88), (30, 30), (500, 300)]:
        grid = np.arange(0, 8, 1e-4)
        tails = binom.sf(v - 1, r, 1 / (1 + np.exp(-grid)))
        best = grid[tails <= 0.05].max()
        assert epsilon_lower_bound(r, v, 0.95) == pytest.approx(best, abs=1.1e-4)


def test_monotone_in_correct_guesses_and_confidence() -> None:
    bounds = [epsilon_lower_bound(200, v) for v in range(100, 201, 5)]
    assert bounds == sorted(bounds)
    assert epsilon_lower_bound(200, 180, 0.99) < epsilon_lower_bound(200, 180, 0.9)
    assert epsilon_lower_bound(0, 0) == 0.0
    assert epsilon_lower_bound(10, 0) == 0.0


# ---------------------------------------------------------------------------------------------
# Soundness: never above the true ε of an exactly DP mechanism (beyond the stated β)
# ---------------------------------------------------------------------------------------------
def _false_alarm_rate_rr(r: int, eps: float, beta: float, shift: int = 0) -> float:
    """Exact P[bound > ε] when the r guesses are randomized response on the canary bits.

    RR with parameter ε is exactly ε-DP and makes the correct count exactly Binomial(r, p_ε), the
    worst case the theorem allows. ``shift`` (test only) counts each outcome as ``shift`` more
    correct guesses, i.e. a bound that is wrong by an off-by-one.
    """
    pmf = binom.pmf(np.arange(r + 1), r, 1 / (1 + math.exp(-eps)))
    alarm = 0.0
    for v in range(r, -1, -1):  # the bound is monotone in v: stop at the first non-alarm
        if epsilon_lower_bound(r, min(r, v + shift), 1 - beta) <= eps:
            break
        alarm += pmf[v]
    return float(alarm)


@pytest.mark.parametrize("r", [20, 100, 500])
@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0, 3.0])
def test_exact_false_alarm_rate_of_randomized_response_is_at_most_beta(r: int, eps: float) -> None:
    # Deterministic: an exact sum over the binomial outcomes (no sampling, no false failures).
    assert _false_alarm_rate_rr(r, eps, 0.05) <= 0.05


def test_the_exact_check_catches_an_off_by_one_bound() -> None:
    # The check above has teeth: a bound that counted one extra correct guess (e.g. using
    # P[B > v] instead of P[B ≥ v]) alarms more often than β for some setting.
    rates = [_false_alarm_rate_rr(r, eps, 0.05, shift=1) for r in (100, 500) for eps in (1.0, 2.0)]
    assert max(rates) > 0.05


def _alarm_threshold(trials: int, beta: float, false_failure: float = 1e-3) -> int:
    """Alarms allowed so that a mechanism alarming at exactly β fails with probability ≤ 1e-3."""
    return int(binom.ppf(1 - false_failure, trials, beta))


def test_laplace_mechanism_with_top_k_guessing_stays_below_epsilon() -> None:
    # Each canary's score is 1[included] + Laplace(1/ε): the Laplace mechanism on the bit, exactly
    # ε-DP per canary. Guesses come from bound_from_scores (top-k / bottom-k, Bonferroni over k).
    # The bound holds jointly at 95%, so alarms ~ Binomial(trials, ≤ 0.05); the threshold below lets
    # an alarm rate of exactly 0.05 fail this test with probability ≤ 1e-3 (false-failure rate).
    eps, m, trials = 2.0, 300, 300
    rng = np.random.default_rng(20230515)
    alarms, bounds = 0, []
    for _ in range(trials):
        bits = rng.random(m) < 0.5
        scores = bits + rng.laplace(scale=1 / eps, size=m)
        b = bound_from_scores(scores, bits, confidence=0.95)
        alarms += b.epsilon > eps
        bounds.append(b.epsilon)
    assert alarms <= _alarm_threshold(trials, 0.05)
    assert np.mean(bounds) > 0.25 * eps  # the simulation is not vacuous: the audit has power


def test_gaussian_mechanism_with_delta_bound_stays_below_epsilon() -> None:
    # Score = μ·1[included] + N(0, 1): the Gaussian mechanism, (ε, δ(ε))-DP for every ε with the
    # exact δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018); ε is solved for δ = 1e-4.
    # Audited with the (ε, δ) bound at that δ; same alarm threshold and false-failure rate (≤ 1e-3)
    # as above. (The one-run bound is far from tight for Gaussian noise, Steinke et al. §6, so this
    # check has slack; the randomized-response and Laplace checks above are the sharp ones.)
    from scipy.optimize import brentq

    mu, delta, m, trials = 2.0, 1e-4, 400, 200
    eps = brentq(
        lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 50
    )
    rng = np.random.default_rng(7)
    alarms, bounds = 0, []
    for _ in range(trials):
        bits = rng.random(m) < 0.5
        scores = mu * bits + rng.standard_normal(m)
        b = bound_from_scores(scores, bits, confidence=0.95, delta=delta)
        alarms += b.epsilon > eps
        bounds.append(b.epsilon)
    assert alarms <= _alarm_threshold(trials, 0.05)
    assert np.mean(bounds) > 0.5  # the audit detects the mechanism


# ---------------------------------------------------------------------------------------------
# From scores to guesses
# ---------------------------------------------------------------------------------------------
def test_guesses_are_counted_from_top_and_bottom_scores() -> None:
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, True, False, True, False, False])
    b = bound_from_scores(scores, included, guess_counts=[(2, 2)])
    assert (b.guesses, b.correct, b.guessed_in, b.guessed_out, b.tries) == (4, 4, 2, 2, 1)
    b = bound_from_scores(scores, included, guess_counts=[(3, 0)])
    assert (b.guesses, b.correct) == (3, 2)
    assert b.epsilon == epsilon_lower_bound(3, 2, 0.95)


def test_bonferroni_correction_over_tries() -> None:
    rng = np.random.default_rng(0)
    bits = rng.random(200) < 0.5
    scores = bits + 0.3 * rng.standard_normal(200)
    pairs = default_guess_counts(200)
    b = bound_from_scores(scores, bits, confidence=0.95)
    assert isinstance(b, OneRunBound) and b.tries == len(pairs)
    per_try = 1 - 0.05 / len(pairs)
    assert b.epsilon == epsilon_lower_bound(b.guesses, b.correct, per_try)
    shared = bound_from_scores(scores, bits, confidence=0.95, share=2)
    assert shared.epsilon <= b.epsilon and shared.confidence == pytest.approx(0.975)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, -0.1, float("nan"), True])
def test_confidence_outside_unit_interval_is_refused(confidence: float) -> None:
    with pytest.raises(InvalidParameterError, match="confidence"):
        epsilon_lower_bound(10, 9, confidence)


def test_inconsistent_counts_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="correct"):
        epsilon_lower_bound(10, 11)
    with pytest.raises(InvalidParameterError, match="canaries"):
        epsilon_lower_bound(10, 9, delta=1e-5)  # m missing
    with pytest.raises(InvalidParameterError, match="canaries"):
        epsilon_lower_bound(10, 9, delta=1e-5, m=5)  # m < r
    with pytest.raises(InvalidParameterError, match="vacuous"):
        epsilon_lower_bound(10, 9, delta=0.1, m=10)  # 2mδ ≥ 1
    with pytest.raises(InvalidParameterError, match="scores"):
        bound_from_scores([1.0, float("nan")], [True, False])
    with pytest.raises(InvalidParameterError, match="guess_counts"):
        bound_from_scores([1.0, 2.0], [True, False], guess_counts=[(2, 1)])


def test_a_fixed_threshold_guesses_every_canary_when_scores_count_inclusions() -> None:
    # 29 of 62 included, scores exact (σ = 0): the top-k menu must guess 31 "in" and errs twice; the
    # threshold rule (fixed before training) guesses all 62 right, and is charged as one more try.
    from veil.audit.bounds import bound_from_scores, default_guess_counts

    included = np.zeros(62, dtype=bool)
    included[:29] = True
    scores = np.where(included, 50.0, 0.0)
    menu = bound_from_scores(scores, included)
    both = bound_from_scores(scores, included, threshold=0.5)
    assert menu.correct < menu.guesses and menu.epsilon < 2.0
    assert both.correct == both.guesses == 62 and both.epsilon > 2.0
    assert both.tries == len(default_guess_counts(62)) + 1
