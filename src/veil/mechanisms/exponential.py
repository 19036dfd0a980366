"""The exponential mechanism, sampled exactly: pick a candidate with probability ∝ exp(ε·u/(2Δ)).

Guarantee. For scores ``u`` whose every entry moves by at most ``Δ`` between neighbouring datasets
(under the caller's relation), one selection is ε-DP and ε-bounded range, hence ε²/8-zCDP
(:class:`~veil.accounting.events.ExponentialMechanism`).

Exact sampling. The probabilities are never computed in floating point. A candidate ``i`` is
proposed uniformly (exact integer draw) and accepted with probability ``exp(-γ_i)``, where
``γ_i = ε·(u_max − u_i)/(2Δ′)`` is an exact rational (floats are rationals) and the Bernoulli is
drawn exactly (Canonne, Kamath & Steinke 2020, Algorithm 1). The accepted index is distributed
exactly ∝ ``exp(ε·u_i/(2Δ′))``; at most ``k`` proposals are expected. ``Δ′ = Δ + 2⁻²⁰`` covers the
rounding of scores computed in float64 (``math.fsum`` of per-cell absolute differences: a relative
error ≤ 2⁻⁵², below 2⁻²¹ in absolute terms for scores under 2³¹, i.e. tables under 2³⁰ rows).
With a :class:`~veil.mechanisms.rng.SecureSource` every random bit comes from the OS CSPRNG.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from veil.accounting.events import ExponentialMechanism
from veil.errors import InvalidParameterError
from veil.mechanisms.discrete import sample_bernoulli_exp
from veil.mechanisms.laplace import _check_rng
from veil.mechanisms.rng import RandomSource

__all__ = ["FLOAT_SCORE_SLACK", "exponential_mechanism"]

FLOAT_SCORE_SLACK = 2.0**-20
"""Added to the stated sensitivity to cover float64 rounding of the scores (module docstring)."""


def exponential_mechanism(
    scores: np.ndarray | list[float], epsilon: float, sensitivity: float, rng: RandomSource
) -> tuple[int, ExponentialMechanism]:
    """The index picked ∝ ``exp(ε·score/(2Δ))`` and the selection's event."""
    rng = _check_rng(rng)
    u = np.asarray(scores, dtype=np.float64)
    if u.ndim != 1 or u.size == 0 or not np.all(np.isfinite(u)):
        raise InvalidParameterError(
            "scores",
            u.shape,
            "the exponential mechanism needs a finite score per candidate",
            "pass a 1-D array",
        )
    event = ExponentialMechanism(epsilon)
    if not (isinstance(sensitivity, (int, float)) and math.isfinite(sensitivity) and sensitivity > 0):
        raise InvalidParameterError(
            "sensitivity", sensitivity, "the selection's ε is relative to the score sensitivity", "pass Δ > 0"
        )
    if u.size == 1:
        return 0, event
    scale = Fraction(epsilon) / (2 * (Fraction(sensitivity) + Fraction(FLOAT_SCORE_SLACK)))
    top = Fraction(float(u.max()))
    gammas = [scale * (top - Fraction(float(v))) for v in u]
    while True:
        i = rng.randbelow(u.size)
        if sample_bernoulli_exp(gammas[i], rng):
            return i, event
