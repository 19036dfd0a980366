"""Report-noisy-max for PATE aggregation: LNMax (Laplace) and GNMax (Gaussian).

``report_noisy_max(counts, noise, scale, rng)`` adds independent noise to each vote count and
returns the index of the largest noisy count (ties: the **smallest index** wins) with the privacy
event of that one answer.

Neighbouring relation: one teacher changes its vote (the teachers are trained on disjoint
partitions, so adding, removing or replacing one training record changes at most one teacher).
Two counts change, one by −1 and one by +1; a teacher that abstains instead changes one count,
which is covered.

* LNMax, ``noise="laplace"``, scale ``b``: the argmax is pure ``ε = 2/b``-DP (the usual
  report-noisy-max argument for counts that each move by ≤ 1, non-monotonically; it holds with
  the smallest-index tie-break and for the exact discrete Laplace of secure mode, since the
  winning set of one count's noise is an upper set and shifting it by 2 changes its probability
  by ≤ e^{2/b}). An argmax is not a Laplace release, so accounting it as
  ``Laplace(b, sensitivity=2)`` would be optimistic under PLD composition. Any pure ε-DP
  mechanism is dominated by randomised response with ε, which is dominated by a Laplace release
  of ``ε_L = 2·ln((1 + e^ε)/2)`` (tight at δ(0); see :func:`dominating_laplace_epsilon`). The
  event is ``Laplace(scale=b, sensitivity=b·ε_L)``: its pure ε is ``ε_L`` (≈ ε + ε²/4), and PLD
  accounting of it is valid.
* GNMax, ``noise="gaussian"``, std ``σ``: the argmax post-processes the noisy count vector, a
  Gaussian mechanism whose L2 sensitivity is ``√2``; event ``Gaussian(σ/√2)`` (seeded) or, with
  the secure lattice correction, ``Gaussian(σ/(√2·(1 + 2Λ)))``.

Secure mode draws exact discrete noise on a lattice ``Λℤ`` with ``Λ`` a power of two ≤ 1 (and
``≤ scale·2⁻²⁰``), so the integer counts lie on the lattice and the argmax is computed on exact
integers. Data-dependent PATE analysis is not done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from veil.accounting.events import Gaussian, Laplace, PrivacyEvent
from veil.errors import InvalidParameterError
from veil.mechanisms.discrete import discrete_gaussian_samples, discrete_laplace_samples
from veil.mechanisms.laplace import _check_rng, _positive, _round_up, laplace_noise, lattice_spacing
from veil.mechanisms.rng import RandomSource

__all__ = [
    "NoiseKind",
    "NoisyMaxResult",
    "dominating_laplace_epsilon",
    "noisy_max_event",
    "report_noisy_max",
]

NoiseKind = Literal["laplace", "gaussian"]


@dataclass(frozen=True)
class NoisyMaxResult:
    """The winning index and the privacy event of this one answer (``grid``: secure lattice)."""

    index: int
    event: PrivacyEvent
    grid: float | None = None


def dominating_laplace_epsilon(epsilon: float) -> float:
    """``ε_L = 2·ln((1 + e^ε)/2)``: a Laplace release with pure ``ε_L`` dominates any pure ε-DP pair.

    Proof sketch: any ε-DP pair is dominated by randomised response RR(ε) (Kairouz et al. 2015),
    and for ``x ∈ [0, ε]`` the hockey-stick curves satisfy
    ``δ_Lap(x) − δ_RR(x) = (1 − e^{x/2})²/(1 + e^ε) ≥ 0``, with
    ``δ_Lap(x) = 1 − e^{(x − ε_L)/2}`` and ``δ_RR(x) = (e^ε − e^x)/(1 + e^ε)``; both pairs are
    symmetric, so this covers every x. Rounded up.
    """
    eps = _positive("epsilon", epsilon, "ε is a pure-DP budget", "pass ε > 0")
    if eps <= 30.0:
        val = 2.0 * math.log1p(math.expm1(eps) / 2.0)
    else:
        val = 2.0 * (eps + math.log1p(math.exp(-eps)) - math.log(2.0))
    return _round_up(val)


def _grid(scale: float) -> float:
    return min(1.0, lattice_spacing(scale, 1.0))


def noisy_max_event(noise: NoiseKind, scale: float, *, secure: bool) -> PrivacyEvent:
    """The event of one report-noisy-max answer (see the module docstring), without running it."""
    if noise == "laplace":
        b = _positive("scale", scale, "the Laplace scale sets the privacy guarantee", "pass b > 0")
        eps_l = dominating_laplace_epsilon(2.0 / b)
        return Laplace(scale=b, sensitivity=_round_up(b * eps_l))
    if noise == "gaussian":
        sigma = _positive("scale", scale, "the Gaussian std sets the privacy guarantee", "pass σ > 0")
        sens = math.sqrt(2.0) * (1.0 + 2.0 * _grid(sigma)) if secure else math.sqrt(2.0)
        return Gaussian(noise_multiplier=math.nextafter(sigma / _round_up(sens), 0.0))
    raise InvalidParameterError(
        "noise", noise, "only Laplace and Gaussian noisy max are analysed", "pass 'laplace' or 'gaussian'"
    )


def _check_counts(counts: object) -> np.ndarray:
    try:
        c = np.asarray(counts, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(
            "counts", type(counts).__name__, "vote counts must be numbers", "pass a 1-D array of ints"
        ) from exc
    if c.ndim != 1 or c.size < 2:
        raise InvalidParameterError(
            "counts",
            c.shape,
            "noisy max needs a 1-D vector of at least two counts",
            "pass one count per class",
        )
    if not np.all(np.isfinite(c)) or not np.all(c == np.round(c)) or np.max(np.abs(c)) >= 2.0**52:
        raise InvalidParameterError(
            "counts",
            "non-integer",
            "the sensitivity (one teacher moves one vote) is stated for integer vote counts",
            "pass integer vote counts",
        )
    return c


def report_noisy_max(
    counts: np.ndarray | list[int], noise: NoiseKind, scale: float, rng: RandomSource
) -> NoisyMaxResult:
    """Index of the largest ``counts[i] + noise_i`` (smallest index on ties) and its event.

    ``scale`` is the Laplace scale ``b`` for ``noise="laplace"`` and the Gaussian std ``σ`` for
    ``noise="gaussian"``, in units of votes.
    """
    rng = _check_rng(rng)
    event = noisy_max_event(noise, scale, secure=rng.secure)
    c = _check_counts(counts)
    k = c.size
    if not rng.secure:
        if noise == "gaussian":
            z = rng.standard_normal(k) * float(scale)
        else:
            z, _ = laplace_noise(float(scale), k, rng)
        return NoisyMaxResult(int(np.argmax(c + z)), event, None)  # argmax: first (smallest) index
    grid = _grid(float(scale))
    inv = int(1.0 / grid)  # Λ = 2^-j ≤ 1, so 1/Λ is an exact integer
    if noise == "gaussian":
        zi = discrete_gaussian_samples((Fraction(float(scale)) * inv) ** 2, k, rng)
    else:
        zi = discrete_laplace_samples(Fraction(float(scale)) * inv, k, rng)
    noisy = [int(ci) * inv + int(zv) for ci, zv in zip(c, zi, strict=True)]  # exact integers, in grid units
    best = max(noisy)
    return NoisyMaxResult(noisy.index(best), event, grid)
