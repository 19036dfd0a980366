"""Noise for a target ε, steps for a budget, ε of a list of events — always on the private side.

All of veil's budget arithmetic lives here, with explicit arguments (no configuration object, no
torch): every job asks these functions rather than composing events itself.

Guarantee. :func:`calibrate_noise` returns a σ whose accounted ε (with the chosen accountant, for
Poisson-sampled Gaussian steps under add/remove-one, after the ``prefix`` events already spent) is
*at most* the target, and which is within 0.5% of the smallest such σ (in practice within 0.05%).
:func:`max_steps` returns the largest step count whose ε (after ``prefix``) is at most the target.
Both check the final answer with the full-resolution accountant, so the search's shortcuts can only
cost tightness, never privacy. :func:`dpsgd_event` is the one place a DP-SGD step's event is built:
a Poisson-sampled Gaussian, and the plain Gaussian at q = 1 (every example in every step: sampling
at rate 1 amplifies nothing, and both accountants account the Gaussian exactly).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from veil.accounting.base import AccountantName, check_delta, check_epsilon, make_accountant
from veil.accounting.events import Composed, Gaussian, PoissonSampled, PrivacyEvent, SelfComposed
from veil.errors import InvalidParameterError, UnreachableTargetError

__all__ = [
    "calibrate_noise",
    "dpsgd_epsilon",
    "dpsgd_event",
    "epsilon_at",
    "epsilon_curve",
    "epsilon_of",
    "max_steps",
    "with_steps",
]

SIGMA_MIN, SIGMA_MAX = 1e-2, 1e5
_REL_TOL = 2e-3  # bracket width on σ at the end of the search (the promise is 0.5%)


def _check_rate(q: float) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or math.isnan(q) or not (0 < q <= 1):
        raise InvalidParameterError(
            "sampling_rate",
            q,
            "the Poisson sampling rate is a probability in (0, 1]; amplification is computed from it",
            "pass q = batch size / dataset size",
        )
    return float(q)


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidParameterError(
            "steps", steps, "the number of noisy steps is what the budget is spent on", "pass an integer ≥ 1"
        )
    return steps


def _check_sigma(sigma: float) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or math.isnan(sigma) or sigma <= 0:
        raise InvalidParameterError(
            "noise_multiplier",
            sigma,
            "σ must be a positive number: without calibrated noise nothing is protected",
            "pass σ > 0, or use calibrate to find one for a target ε",
        )
    return float(sigma)


def dpsgd_event(sampling_rate: float, noise_multiplier: float) -> PrivacyEvent:
    """The event of one DP-SGD step: a Poisson-sampled Gaussian (plain Gaussian when q = 1)."""
    q = _check_rate(sampling_rate)
    g = Gaussian(_check_sigma(noise_multiplier))
    return g if q == 1.0 else PoissonSampled(q, g)


def with_steps(prefix: Sequence[PrivacyEvent], step: PrivacyEvent, count: int) -> list[PrivacyEvent]:
    """``prefix`` followed by ``count`` repetitions of ``step`` (as one :class:`SelfComposed`)."""
    return [*prefix, SelfComposed(step, count)] if count > 0 else list(prefix)


def epsilon_of(events: Sequence[PrivacyEvent], delta: float, accountant: AccountantName = "pld") -> float:
    """ε at ``delta`` of the composition of ``events`` (0 for none), with the named accountant."""
    acc = make_accountant(accountant)
    if events:
        acc.compose(Composed(list(events)))
    return float(acc.epsilon(check_delta(delta)))


def epsilon_curve(
    step: PrivacyEvent,
    total: int,
    delta: float,
    accountant: AccountantName = "pld",
    *,
    prefix: Sequence[PrivacyEvent] = (),
    points: int = 12,
) -> list[tuple[int, float]]:
    """ε after ``prefix`` and k steps, for k = 0, ``total`` and about ``points`` values between."""
    ks = sorted({0, total, *np.linspace(0, total, num=min(total, points) + 1).round().astype(int).tolist()})
    return [(int(k), epsilon_of(with_steps(prefix, step, int(k)), delta, accountant)) for k in ks]


def epsilon_at(curve: Sequence[tuple[int, float]], k: int) -> float:
    """ε after k steps read off an :func:`epsilon_curve`, rounded up to the next computed point."""
    for s, e in curve:
        if s >= k:
            return e
    return curve[-1][1]


def dpsgd_epsilon(
    sampling_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: AccountantName = "pld",
    *,
    fft_points: int | None = None,
) -> float:
    """ε after ``steps`` Poisson-sampled Gaussian steps, at ``delta``."""
    event = dpsgd_event(sampling_rate, noise_multiplier)
    steps = _check_steps(steps)
    delta = check_delta(delta)
    acc = make_accountant(accountant)
    if fft_points is not None and hasattr(acc, "fft_points"):
        acc.fft_points = fft_points
    return acc.compose(event, steps).epsilon(delta)


def _check_target(target_epsilon: float) -> float:
    target = check_epsilon(target_epsilon, "target_epsilon")
    if target == 0 or math.isinf(target):
        raise InvalidParameterError(
            "target_epsilon",
            target_epsilon,
            "ε = 0 needs infinite noise and ε = ∞ promises nothing",
            "pass a finite ε > 0, e.g. 1 to 8",
        )
    return target


def _coarse_then_fine(accountant: AccountantName) -> tuple[int | None, int | None]:
    # A coarse PLD grid is ~10× faster and within ~0.5% of the fine one: good for the search.
    return (1 << 14, None) if accountant == "pld" else (None, None)


def _search_sigma(
    eps_of: Callable[[float], float], target: float, lo: float, hi: float, rel_tol: float
) -> float:
    """Smallest σ in [lo, hi] (to rel_tol) with eps_of(σ) ≤ target; eps_of(hi) ≤ target < eps_of(lo)."""
    e_lo, e_hi = eps_of(lo), eps_of(hi)
    f_lo = math.log(e_lo) if e_lo < math.inf else math.inf
    f_hi = math.log(e_hi) if e_hi > 0 else -math.inf  # ε can round to 0 at a huge σ
    log_t = math.log(target)
    a, b = math.log(lo), math.log(hi)
    while b - a > math.log1p(rel_tol):
        # Secant step in (log σ, log ε) — nearly linear there — safeguarded by bisection.
        if math.isfinite(f_lo) and f_lo != f_hi:
            m = a + (f_lo - log_t) * (b - a) / (f_lo - f_hi)
            m = min(max(m, a + 0.1 * (b - a)), b - 0.1 * (b - a))
        else:
            m = (a + b) / 2
        e = eps_of(math.exp(m))
        if e <= target:
            b, f_hi = m, math.log(e) if e > 0 else -math.inf
        else:
            a, f_lo = m, math.log(e) if e < math.inf else math.inf
    return math.exp(b)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: AccountantName = "pld",
    *,
    prefix: Sequence[PrivacyEvent] = (),
) -> float:
    """The smallest σ (to 0.5%) such that ``prefix`` then ``steps`` DP-SGD steps at rate q are
    (target_ε, δ)-DP. ``prefix``: events already spent or planned before the steps (e.g. a DP
    preprocessing release); refused when they alone reach the target."""
    target = _check_target(target_epsilon)
    delta = check_delta(delta)
    q = _check_rate(sampling_rate)
    steps = _check_steps(steps)
    make_accountant(accountant)  # validates the name before any work
    if prefix:
        return _calibrate_after(prefix, target, delta, q, steps, accountant)
    coarse_points, fine_points = _coarse_then_fine(accountant)

    @functools.cache
    def eps_fine(sigma: float) -> float:
        return dpsgd_epsilon(q, sigma, steps, delta, accountant, fft_points=fine_points)

    @functools.cache
    def eps_coarse(sigma: float) -> float:
        return dpsgd_epsilon(q, sigma, steps, delta, accountant, fft_points=coarse_points)

    if eps_fine(SIGMA_MAX) > target:
        raise UnreachableTargetError(
            "target_epsilon",
            target_epsilon,
            f"even σ = {SIGMA_MAX:g} cannot keep {steps} steps at q = {q:g} within ε at δ = {delta:g}",
            "raise the target ε or δ, or train for fewer steps / with a smaller sampling rate",
        )
    # Bracket with the coarse accountant, starting from σ = 1 and growing/shrinking by 2×.
    lo, hi = 0.5, 1.0
    while eps_coarse(hi) > target and hi < SIGMA_MAX:
        lo, hi = hi, min(2 * hi, SIGMA_MAX)
    while eps_coarse(lo) <= target and lo > SIGMA_MIN:
        lo, hi = max(lo / 2, SIGMA_MIN), lo
    if eps_coarse(lo) <= target:
        return (
            SIGMA_MIN
            if eps_fine(SIGMA_MIN) <= target
            else _search_sigma(eps_fine, target, SIGMA_MIN, hi, _REL_TOL)
        )
    guess = _search_sigma(eps_coarse, target, lo, hi, _REL_TOL) if coarse_points else hi
    # Re-bracket around the coarse answer with the fine accountant, widening until it holds.
    width = 1.003  # the coarse grid is within ~0.1% of the fine one
    lo, hi = guess / width, guess * width
    while eps_fine(hi) > target:
        lo, hi = hi, hi * width
        width *= 2
    while eps_fine(lo) <= target and lo > SIGMA_MIN:
        lo, hi = max(lo / width, SIGMA_MIN), lo
        width *= 2
    return _search_sigma(eps_fine, target, lo, hi, _REL_TOL)


def max_steps(
    noise_multiplier: float,
    sampling_rate: float,
    target_epsilon: float,
    delta: float,
    accountant: AccountantName = "pld",
    *,
    limit: int = 10**8,
    prefix: Sequence[PrivacyEvent] = (),
) -> int:
    """The most DP-SGD steps (≤ ``limit``) whose ε, after the ``prefix`` events already spent, stays
    at or below the target (0 if not even one fits)."""
    sigma = _check_sigma(noise_multiplier)
    q = _check_rate(sampling_rate)
    target = _check_target(target_epsilon)
    delta = check_delta(delta)
    make_accountant(accountant)
    if prefix:
        return _steps_after(prefix, dpsgd_event(q, sigma), target, delta, accountant, limit)

    coarse_points, _ = _coarse_then_fine(accountant)

    def fits(steps: int, points: int | None = None) -> bool:
        return dpsgd_epsilon(q, sigma, steps, delta, accountant, fft_points=points) <= target

    if not fits(1):
        return 0
    # Coarse search for the order of magnitude, then an exact bracket with the full accountant.
    lo, hi = 1, 2
    while hi <= limit and fits(hi, coarse_points):
        lo, hi = hi, hi * 2
    guess = _bisect_steps(lambda n: fits(n, coarse_points), lo, min(hi, limit + 1))
    lo, hi = max(1, int(guess * 0.98)), min(limit + 1, int(guess * 1.02) + 2)
    while not fits(lo):
        lo, hi = max(1, lo // 2), lo
    while hi <= limit and fits(hi):
        lo, hi = hi, min(limit + 1, hi * 2)
    return _bisect_steps(fits, lo, hi)


def _bisect_steps(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _calibrate_after(
    prefix: Sequence[PrivacyEvent],
    target: float,
    delta: float,
    q: float,
    steps: int,
    accountant: AccountantName,
) -> float:
    """Smallest σ (to 0.2%) with ε(prefix + steps) ≤ target: a geometric bisection from the σ of the
    steps alone (a lower bound), each candidate checked with the full-resolution accountant."""
    if epsilon_of(prefix, delta, accountant) >= target:
        raise UnreachableTargetError(
            "target_epsilon",
            target,
            "the events spent before training already use the whole target ε, leaving nothing for it",
            "spend less before training (e.g. a smaller preprocessing budget) or raise the target ε",
        )

    def fits(sigma: float) -> bool:
        return epsilon_of(with_steps(prefix, dpsgd_event(q, sigma), steps), delta, accountant) <= target

    lo = calibrate_noise(target, delta, q, steps, accountant)
    hi = lo * 1.25
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > SIGMA_MAX:
            raise UnreachableTargetError(
                "target_epsilon", target, "no noise level fits this run", "raise the target ε"
            )
    while hi / lo > 1.002:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _steps_after(
    prefix: Sequence[PrivacyEvent],
    step: PrivacyEvent,
    target: float,
    delta: float,
    accountant: AccountantName,
    limit: int,
) -> int:
    """Largest k ≤ limit with ε(prefix + k steps) ≤ target, by bisection (0 if none fits)."""

    def fits(k: int) -> bool:
        return epsilon_of(with_steps(prefix, step, k), delta, accountant) <= target

    if limit <= 0 or fits(limit):
        return max(limit, 0)
    if not fits(0):
        return 0
    return _bisect_steps(fits, 0, limit)
