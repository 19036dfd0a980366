"""Exact samplers on integer arithmetic (Canonne, Kamath & Steinke 2020).

No floating point is used on the sampling path: parameters are rationals
(:class:`fractions.Fraction` or int), randomness is integers from a
:class:`~veil.mechanisms.rng.RandomSource` (``randbelow``/``random_bits``), and every decision is
an exact integer comparison. The output distributions are therefore exactly

* :func:`sample_bernoulli_exp`: ``P(True) = exp(-γ)`` for rational ``γ ≥ 0``;
* :func:`sample_discrete_laplace`: ``P(Z = z) ∝ exp(-|z|/t)`` on ℤ, rational ``t > 0``;
* :func:`sample_discrete_gaussian`: ``P(Z = z) ∝ exp(-z²/(2σ²))`` on ℤ, rational ``σ² > 0``,

up to the quality of the source's bits (exact uniform bits from a :class:`SecureSource`). Running
time depends on the random outcomes (rejection loops), so these samplers do not hide timing.

The vectorised wrappers (``discrete_*_samples``) loop in Python; about 10⁴ samples per second
per sampler is the expected order of magnitude.
"""

from __future__ import annotations

from fractions import Fraction
from math import isqrt

import numpy as np

from veil.errors import InvalidParameterError
from veil.mechanisms.rng import RandomSource, _check_size

__all__ = [
    "discrete_gaussian_samples",
    "discrete_laplace_samples",
    "sample_bernoulli_exp",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
]

Rational = Fraction | int


def _as_fraction(name: str, value: object, *, positive: bool) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (Fraction, int)):
        raise InvalidParameterError(
            name,
            value,
            "exact samplers take rationals so no floating-point rounding enters the sampling path",
            "pass an int or fractions.Fraction (Fraction(x) of a float is exact)",
        )
    frac = Fraction(value)
    if frac < 0 or (positive and frac == 0):
        raise InvalidParameterError(
            name,
            value,
            "a noise scale must be > 0" if positive else "γ must be ≥ 0",
            "pass a value > 0",
        )
    return frac


# -- Bernoulli ------------------------------------------------------------------------------------
def _bernoulli(num: int, den: int, rng: RandomSource) -> bool:
    """True with probability ``num/den`` (0 ≤ num ≤ den)."""
    return rng.randbelow(den) < num


def _bernoulli_exp_le1(num: int, den: int, rng: RandomSource) -> bool:
    """True w.p. ``exp(-num/den)`` for ``0 ≤ num/den ≤ 1``.

    Draw ``A_k ~ Bernoulli(γ/k)`` for k = 1, 2, ... until the first failure at step K; then
    ``P(K odd) = Σ_k (-γ)^k / k! = exp(-γ)`` (CKS 2020, Algorithm 1).
    """
    k = 1
    while _bernoulli(num, den * k, rng):
        k += 1
    return k % 2 == 1


def _bernoulli_exp(num: int, den: int, rng: RandomSource) -> bool:
    """True w.p. ``exp(-num/den)`` for any ``num/den ≥ 0``: ``exp(-1)^⌊γ⌋ · exp(-(γ-⌊γ⌋))``."""
    whole, rest = divmod(num, den)
    for _ in range(whole):
        if not _bernoulli_exp_le1(1, 1, rng):
            return False
    return _bernoulli_exp_le1(rest, den, rng)


def sample_bernoulli_exp(gamma: Rational, rng: RandomSource) -> bool:
    """Exactly Bernoulli(exp(-γ)) for rational ``γ ≥ 0``."""
    g = _as_fraction("gamma", gamma, positive=False)
    return _bernoulli_exp(g.numerator, g.denominator, rng)


# -- discrete Laplace -----------------------------------------------------------------------------
def _geometric_exp(n: int, d: int, rng: RandomSource) -> int:
    """``Y ≥ 0`` with ``P(Y = y) ∝ exp(-y·d/n)``.

    ``X = U + n·V`` with ``U`` uniform on ``{0..n-1}`` kept w.p. ``exp(-U/n)`` and
    ``V ~ Geometric`` counting successes of Bernoulli(exp(-1)) has ``P(X = x) ∝ exp(-x/n)``;
    then ``Y = ⌊X/d⌋`` sums ``d`` consecutive terms: ``P(Y = y) ∝ exp(-y·d/n)``.
    """
    while True:
        u = rng.randbelow(n)
        if _bernoulli_exp_le1(u, n, rng):
            break
    v = 0
    while _bernoulli_exp_le1(1, 1, rng):
        v += 1
    return (u + n * v) // d


def _discrete_laplace(n: int, d: int, rng: RandomSource) -> int:
    """``Z`` with ``P(Z = z) ∝ exp(-|z|·d/n)``: a random sign on a geometric, rejecting ``-0``."""
    while True:
        y = _geometric_exp(n, d, rng)
        negative = rng.random_bits(1) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def sample_discrete_laplace(scale: Rational, rng: RandomSource) -> int:
    """One draw of the discrete Laplace ``P(Z = z) ∝ exp(-|z|/t)`` on ℤ, ``t = scale > 0`` rational."""
    t = _as_fraction("scale", scale, positive=True)
    return _discrete_laplace(t.numerator, t.denominator, rng)


def discrete_laplace_samples(scale: Rational, size: int | tuple[int, ...], rng: RandomSource) -> np.ndarray:
    """An int64 array of i.i.d. discrete Laplace draws (see :func:`sample_discrete_laplace`)."""
    t = _as_fraction("scale", scale, positive=True)
    shape = _check_size(size)
    n, d = t.numerator, t.denominator
    flat = [_discrete_laplace(n, d, rng) for _ in range(int(np.prod(shape, dtype=np.int64)))]
    return np.array(flat, dtype=np.int64).reshape(shape)


# -- discrete Gaussian ----------------------------------------------------------------------------
def _discrete_gaussian(a: int, b: int, rng: RandomSource) -> int:
    """``Z`` with ``P(Z = z) ∝ exp(-z²/(2σ²))``, ``σ² = a/b`` (CKS 2020, Algorithm 3).

    Propose ``Y`` from the discrete Laplace with integer scale ``t = ⌊σ⌋ + 1`` and accept with
    probability ``exp(-(|Y| - σ²/t)² / (2σ²))``; the product of the two weights is proportional to
    ``exp(-Y²/(2σ²))`` (the cross terms are constant in ``Y``). With ``σ² = a/b``:
    ``(|Y| - σ²/t)²/(2σ²) = (|Y|·b·t - a)² / (2·a·b·t²)``, all integers.
    """
    t = _isqrt_floor_frac(a, b) + 1
    den = 2 * a * b * t * t
    while True:
        y = _discrete_laplace(t, 1, rng)
        num = (abs(y) * b * t - a) ** 2
        if _bernoulli_exp(num, den, rng):
            return y


def _isqrt_floor_frac(a: int, b: int) -> int:
    """``⌊√(a/b)⌋`` exactly."""
    r = isqrt(a // b)
    while (r + 1) * (r + 1) * b <= a:
        r += 1
    while r * r * b > a:
        r -= 1
    return r


def sample_discrete_gaussian(sigma2: Rational, rng: RandomSource) -> int:
    """One draw of the discrete Gaussian ``N_ℤ(0, σ²)``: ``P(Z = z) ∝ exp(-z²/(2σ²))``, rational σ²."""
    s2 = _as_fraction("sigma2", sigma2, positive=True)
    return _discrete_gaussian(s2.numerator, s2.denominator, rng)


def discrete_gaussian_samples(sigma2: Rational, size: int | tuple[int, ...], rng: RandomSource) -> np.ndarray:
    """An int64 array of i.i.d. discrete Gaussian draws (see :func:`sample_discrete_gaussian`)."""
    s2 = _as_fraction("sigma2", sigma2, positive=True)
    shape = _check_size(size)
    a, b = s2.numerator, s2.denominator
    flat = [_discrete_gaussian(a, b, rng) for _ in range(int(np.prod(shape, dtype=np.int64)))]
    return np.array(flat, dtype=np.int64).reshape(shape)
