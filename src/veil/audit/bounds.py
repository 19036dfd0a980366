"""Empirical ε lower bounds from one training run (Steinke, Nasr & Jagielski 2023).

The game. ``m`` canaries are each included in the training run independently with probability ½
(inclusion bits ``S ∈ {−1, +1}^m``). After training, the auditor looks at the output and guesses, for
``r`` of the canaries, whether each was included (abstaining on the others); ``v`` guesses are right.

Guarantee (what a reported bound means). If training is (ε, δ)-DP with respect to adding or removing
any one canary (add/remove-one neighbouring, the relation DP-SGD's accounting uses), then, whatever
the scores and however the ``r`` guesses are chosen from the output,

* pure DP (δ = 0, their Theorem 3.1): the number of correct guesses W is stochastically dominated by
  ``Binomial(r, p)`` with ``p = e^ε / (1 + e^ε)``, so ``P[W ≥ v] ≤ f_ε(v) := P[Binomial(r, p) ≥ v]``;
* approximate DP (their Theorem 3.3): ``P[W ≥ v] ≤ f_ε(v) + 2mδ · max_{1≤i≤v} (f_ε(v−i) − f_ε(v)) / i``.

:func:`p_value` is the right-hand side. :func:`epsilon_lower_bound` returns the largest ε whose
p-value is at most β = 1 − confidence (the root, found with a bracketing root finder, then rounded
*down* to a multiple of 10⁻⁶ and re-checked): with probability at least ``confidence`` over the
canary bits and the training randomness, the true ε of the run is at least the reported bound. A
bound of 0 means "no evidence of leakage at this confidence", never "private".

The p-value is increasing in ε (for δ > 0 this needs ``2mδ < 1``, which is enforced: the bound is
then, for every ``i``, a convex combination of the increasing tails ``f_ε(v)`` and ``f_ε(v−i)``), so
the root is unique and every ε below it is rejected.

:func:`bound_from_scores` turns per-canary scores into guesses (the ``k`` highest scores guessed
"included", optionally the ``k`` lowest guessed "excluded") for a fixed menu of ``k``; trying
several guess counts and keeping the best is paid for with a Bonferroni correction (each is tested at
β / number of tries), so the reported maximum keeps the stated confidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from veil.errors import InvalidParameterError

__all__ = [
    "OneRunBound",
    "bound_from_scores",
    "check_confidence",
    "default_guess_counts",
    "epsilon_lower_bound",
    "p_value",
]

RESOLUTION = 1e-6
"""Reported bounds are rounded down to a multiple of this."""

_EPS_MAX = 1e4


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidParameterError(name, value, "it counts guesses or canaries", "pass an integer ≥ 0")
    return int(value)


def check_confidence(confidence: Any) -> float:
    """``confidence`` as a float in (0, 1), else :class:`~veil.errors.InvalidParameterError`."""
    if (
        isinstance(confidence, bool)
        or not isinstance(confidence, (int, float, np.floating))
        or not math.isfinite(confidence)
        or not 0 < confidence < 1
    ):
        raise InvalidParameterError(
            "confidence",
            confidence,
            "a lower bound on ε holds with a probability that must lie strictly between 0 and 1 "
            "(1 would need infinitely many canaries)",
            "pass e.g. --confidence 0.95",
        )
    return float(confidence)


def _check(r: Any, v: Any, delta: Any, m: Any) -> tuple[int, int, float, int]:
    r = _check_count("guesses", r)
    v = _check_count("correct", v)
    if v > r:
        raise InvalidParameterError(
            "correct", v, f"there cannot be more correct guesses than guesses ({r})", "pass v ≤ r"
        )
    if (
        isinstance(delta, bool)
        or not isinstance(delta, (int, float, np.floating))
        or not (math.isfinite(delta) and 0 <= delta < 1)
    ):
        raise InvalidParameterError(
            "delta", delta, "δ is a probability in [0, 1)", "pass the δ of the audited guarantee"
        )
    delta = float(delta)
    if delta > 0:
        if m is None:
            raise InvalidParameterError(
                "canaries",
                None,
                "the (ε, δ) bound charges 2·m·δ for the m canaries of the game",
                "pass m, the number of canaries",
            )
        m = _check_count("canaries", m)
        if m < r:
            raise InvalidParameterError(
                "canaries", m, f"there are fewer canaries than guesses ({r})", "pass m ≥ r"
            )
        if 2 * m * delta >= 1:
            raise InvalidParameterError(
                "canaries",
                m,
                f"with 2·m·δ = {2 * m * delta:.3g} ≥ 1 the (ε, δ) one-run bound is vacuous",
                "use fewer canaries or audit a smaller δ",
            )
    else:
        m = r if m is None else _check_count("canaries", m)
    return r, v, delta, int(m)


def _tail(r: int, p: float, v: int) -> float:
    """``P[Binomial(r, p) ≥ v]`` (``scipy.special.bdtrc``: what ``scipy.stats.binom.sf`` evaluates,
    without its per-call argument handling)."""
    from scipy.special import bdtrc

    if v <= 0:
        return 1.0
    return float(bdtrc(v - 1, r, p))


def _p_value(r: int, v: int, epsilon: float, delta: float, m: int) -> float:
    from scipy.special import expit
    from scipy.stats import binom

    p = float(expit(epsilon))  # e^ε / (1 + e^ε), stable for large ε
    tail = _tail(r, p, v)
    if delta == 0 or v == 0:
        return min(1.0, tail)
    # (f(v−i) − f(v)) = P[v−i ≤ B < v] = Σ_{k=v−i}^{v−1} pmf(k); for i > v the numerator stays
    # 1 − f(v) while i grows, so the maximum is reached at some i ≤ v.
    pmf = binom.pmf(np.arange(v - 1, -1, -1), r, p)  # pmf(v−1), pmf(v−2), ..., pmf(0)
    alpha = float(np.max(np.cumsum(pmf) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def p_value(r: int, v: int, epsilon: float, *, delta: float = 0.0, m: int | None = None) -> float:
    """The bound on ``P[W ≥ v]`` for r guesses against an (ε, δ)-DP run with m canaries (see module)."""
    r, v, delta, m = _check(r, v, delta, m)
    if not (isinstance(epsilon, (int, float, np.floating)) and epsilon >= 0 and not math.isnan(epsilon)):
        raise InvalidParameterError("epsilon", epsilon, "ε is a number ≥ 0", "pass ε ≥ 0")
    return _p_value(r, v, float(epsilon), delta, m)


def epsilon_lower_bound(
    r: int, v: int, confidence: float = 0.95, *, delta: float = 0.0, m: int | None = None
) -> float:
    """The ε lower bound at ``confidence`` from ``v`` correct out of ``r`` guesses (see the module).

    ``delta = 0`` gives the pure-DP bound; ``delta > 0`` the (ε, δ) bound, which needs ``m`` (the
    number of canaries, ≥ r) and ``2mδ < 1``. Rounded down to a multiple of 10⁻⁶.
    """
    r, v, delta, m = _check(r, v, delta, m)
    beta = 1.0 - check_confidence(confidence)

    def excess(eps: float) -> float:
        return _p_value(r, v, eps, delta, m) - beta

    if r == 0 or excess(0.0) > 0:
        return 0.0
    hi = 1.0
    while excess(hi) <= 0:
        hi *= 2
        if hi > _EPS_MAX:  # pragma: no cover - needs astronomically many correct guesses
            return math.floor(_EPS_MAX / RESOLUTION) * RESOLUTION
    from scipy.optimize import brentq

    root = float(brentq(excess, 0.0, hi, xtol=1e-9, rtol=1e-12, maxiter=500))
    bound = round(math.floor(root / RESOLUTION) * RESOLUTION, 6)
    # The p-value is increasing in ε; step down until the reported value is certainly rejected.
    while bound > 0 and excess(bound) > 0:
        bound = max(0.0, round(bound - RESOLUTION, 6))
    return bound


# ---------------------------------------------------------------------------------------------
# From scores to guesses
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OneRunBound:
    """An ε lower bound from one run, with the guesses that gave it."""

    epsilon: float
    """The lower bound (0: no evidence of leakage at this confidence)."""
    confidence: float
    """Joint confidence of the bound (after the Bonferroni correction over the tries)."""
    delta: float
    canaries: int
    guesses: int
    correct: int
    guessed_in: int
    guessed_out: int
    tries: int
    """How many guess counts were tried (each tested at β / tries)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_guess_counts(m: int) -> list[tuple[int, int]]:
    """A fixed menu of (k_in, k_out): top-k only and top-k + bottom-k, k a share of m."""
    out: list[tuple[int, int]] = []
    for share in (0.02, 0.05, 0.1, 0.2, 0.5):
        k = max(1, math.ceil(share * m))
        for pair in ((k, 0), (k, k)):
            if sum(pair) <= m and pair not in out:
                out.append(pair)
    return out


def _check_scores(scores: Any, included: Any) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).ravel()
    inc = np.asarray(included).ravel()
    if s.size != inc.size or s.size == 0:
        raise InvalidParameterError(
            "scores",
            f"{s.size} scores for {inc.size} canaries",
            "each canary needs exactly one score",
            "pass one score per canary",
        )
    if np.isnan(s).any():
        raise InvalidParameterError(
            "scores", "NaN", "a canary without a score cannot be ranked", "score every canary"
        )
    return s, inc.astype(bool)


def bound_from_scores(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    confidence: float = 0.95,
    delta: float = 0.0,
    guess_counts: Sequence[tuple[int, int]] | None = None,
    share: int = 1,
    threshold: float | None = None,
) -> OneRunBound:
    """The best bound over ``guess_counts`` (default :func:`default_guess_counts`), Bonferroni-corrected.

    Higher score = "more likely included". For each (k_in, k_out) the k_in highest-scoring canaries
    are guessed included and the k_out lowest excluded (ties broken by index, a fixed rule). With a
    ``threshold`` (fixed before training, never from the bits), one more try guesses every canary:
    included iff its score exceeds the threshold (e.g. 0.5 for scores that count inclusions exactly,
    where the top-k menu would have to guess the number of included canaries). Each try is tested at
    β / (tries · share); ``share`` > 1 reserves room for other bounds reported jointly (e.g. input
    and gradient canaries of one run, each audited at β / 2).
    """
    s, inc = _check_scores(scores, included)
    conf = check_confidence(confidence)
    if isinstance(share, bool) or not isinstance(share, int) or share < 1:
        raise InvalidParameterError("share", share, "it counts jointly reported bounds", "pass an int ≥ 1")
    m = s.size
    pairs = list(guess_counts) if guess_counts is not None else default_guess_counts(m)
    for k_in, k_out in pairs:
        if min(k_in, k_out) < 0 or k_in + k_out < 1 or k_in + k_out > m:
            raise InvalidParameterError(
                "guess_counts",
                (k_in, k_out),
                f"the guessed canaries must be distinct and there are {m}",
                "pass 1 ≤ k_in + k_out ≤ m",
            )
    tries = len(pairs) + (threshold is not None)
    per_try = 1.0 - (1.0 - conf) / (tries * share)
    order = np.argsort(-s, kind="stable")  # highest first, ties by index
    rules: list[tuple[np.ndarray, np.ndarray]] = [
        (order[:k_in], order[m - k_out :] if k_out else order[:0]) for k_in, k_out in pairs
    ]
    if threshold is not None:
        rules.append((np.flatnonzero(s > threshold), np.flatnonzero(s <= threshold)))
    best: OneRunBound | None = None
    for top, bottom in rules:
        k_in, k_out = len(top), len(bottom)
        v = int(inc[top].sum() + (~inc[bottom]).sum())
        r = k_in + k_out
        eps = epsilon_lower_bound(r, v, per_try, delta=delta, m=m if delta > 0 else None)
        candidate = OneRunBound(
            epsilon=eps,
            confidence=1.0 - (1.0 - conf) / share,
            delta=float(delta),
            canaries=m,
            guesses=r,
            correct=v,
            guessed_in=k_in,
            guessed_out=k_out,
            tries=tries,
        )
        if best is None or eps > best.epsilon:
            best = candidate
    assert best is not None
    return best
