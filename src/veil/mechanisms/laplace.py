"""The Laplace mechanism, and what every mechanism returns (:class:`MechanismResult`).

``laplace_mechanism(x, sensitivity=Δ, scale=b, rng=...)`` releases ``x + Lap(b)`` per coordinate
for a query whose **L1 sensitivity** is ``Δ`` under the neighbouring relation the caller analyses
(add/remove one record or replace one: the mechanism does not care, the caller states Δ for the
relation it uses). The release is pure ``ε = Δ/b``-DP, and the returned event is
``Laplace(scale=b, sensitivity=Δ)``.

Seeded vs secure (the ``rng``):

* seeded — textbook floating-point sampling ``b·(E₁ − E₂)`` with ``E = −ln(1−U)``. Fast and
  reproducible, but (Mironov 2012) the set of doubles it can output depends on ``x``, so an exact
  output can reveal the input. For research runs only.
* secure — the query is rounded to the lattice ``Λℤ`` (``Λ`` a power of two,
  ``Λ ≤ b·2⁻²⁰/d`` for ``d`` coordinates) and integer noise ``Λ·Z``, ``Z`` the exact discrete
  Laplace with scale ``t = b/Λ`` (:mod:`veil.mechanisms.discrete`), is added. Every output is a
  lattice point reachable from *every* input, so the floating-point attack has nothing to see.
  Its guarantee, proved in ``docs/mechanisms.md``: the rounded query has integer L1 sensitivity
  ``≤ Δ/Λ + d``, and a discrete Laplace with integer shift ``m ≥ 1`` is dominated (for every
  (ε, δ), hence under composition) by a continuous Laplace with shift ``m + 1/(4t)``. The event
  returned is therefore ``Laplace(scale=b, sensitivity=Δ + d·Λ·(1 + Λ/(4b)))``: pure
  ``ε ≤ Δ/b·(1 + 2⁻²⁰·1.0001)`` — the rounding costs a relative ~10⁻⁶.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from veil.accounting.events import Laplace, PrivacyEvent
from veil.errors import InvalidParameterError
from veil.mechanisms.discrete import discrete_laplace_samples
from veil.mechanisms.rng import RandomSource

__all__ = [
    "GRID_BITS",
    "MechanismResult",
    "laplace_event",
    "laplace_mechanism",
    "laplace_noise",
    "laplace_scale",
    "lattice_spacing",
]

GRID_BITS = 20
"""Secure mode rounds to a lattice at least ``2**GRID_BITS`` times finer than the noise scale."""


@dataclass(frozen=True)
class MechanismResult:
    """A noisy release and the privacy event that accounts for it.

    ``value`` is a float for a scalar query and a float64 array (same shape) otherwise. ``grid`` is
    the lattice spacing ``Λ`` every output lies on (secure mode), or ``None`` (seeded mode).
    """

    value: float | np.ndarray
    event: PrivacyEvent
    grid: float | None = None


def _positive(name: str, value: float, why: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidParameterError(name, value, f"{why}; it must be a real number", fix)
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise InvalidParameterError(name, value, f"{why}; it must be finite and > 0", fix)
    return v


def _sensitivity(value: float, norm: str) -> float:
    return _positive(
        "sensitivity", value, f"the {norm} sensitivity bounds one record's influence", "pass Δ > 0"
    )


def _check_rng(rng: object) -> RandomSource:
    if not isinstance(rng, RandomSource):
        raise InvalidParameterError(
            "rng",
            type(rng).__name__,
            "noise must come from a veil RandomSource so the run states whether it is secure",
            "pass veil.mechanisms.make_source(secure=..., seed=...)",
        )
    return rng


def _query_array(value: object) -> np.ndarray:
    try:
        x = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(
            "value", type(value).__name__, "the query answer must be numeric", "pass a number or array"
        ) from exc
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise InvalidParameterError(
            "value",
            "empty" if x.size == 0 else "non-finite",
            "a NaN/inf or empty answer has no bounded sensitivity to protect",
            "clip or fix the query so it returns finite numbers",
        )
    return x


def _wrap(x: np.ndarray, like_scalar: bool) -> float | np.ndarray:
    return float(x.reshape(())) if like_scalar else x


def lattice_spacing(scale: float, coordinates: float = 1.0) -> float:
    """The secure-mode lattice ``Λ``: the largest power of two ≤ ``scale / coordinates · 2⁻²⁰``.

    Depends only on public parameters (the noise scale and the number of coordinates), never on
    the data.
    """
    scale = _positive("scale", scale, "the lattice is derived from the noise scale", "pass a scale > 0")
    _, exp = math.frexp(scale / max(1.0, coordinates))  # scale/coords ∈ [2^(exp-1), 2^exp)
    grid = math.ldexp(1.0, exp - 1 - GRID_BITS)
    if not (grid > 0 and math.isfinite(grid)):
        raise InvalidParameterError(
            "scale", scale, "the secure lattice for this scale is not representable", "rescale the query"
        )
    return grid


def _round_up(x: float) -> float:
    """``x`` moved up two ulps, so float rounding in a bound can only make it more conservative."""
    return math.nextafter(math.nextafter(x, math.inf), math.inf)


def _secure_laplace_sensitivity(sensitivity: float, scale: float, grid: float, coordinates: int) -> float:
    """The sensitivity of the Laplace event that dominates the lattice release (rounded up).

    Rounding adds ≤ 1 lattice unit per coordinate to the integer L1 shift, and a discrete
    Laplace with integer shift ``m`` is dominated by a continuous one with shift
    ``m + 2t·ln cosh(1/(2t)) ≤ m + 1/(4t)`` (``t = scale/grid``), per changed coordinate.
    """
    return _round_up(sensitivity + coordinates * grid * (1.0 + grid / (4.0 * scale)))


def laplace_scale(epsilon: float, sensitivity: float) -> float:
    """The Laplace scale ``b = Δ/ε`` that makes a query of L1 sensitivity ``Δ`` pure ε-DP."""
    eps = _positive("epsilon", epsilon, "ε is the privacy budget of the release", "pass ε > 0")
    sens = _sensitivity(sensitivity, "L1")
    return sens / eps


def laplace_event(sensitivity: float, scale: float, *, coordinates: int, secure: bool) -> Laplace:
    """The event :func:`laplace_mechanism` returns for this setting, without releasing anything."""
    sens = _sensitivity(sensitivity, "L1")
    b = _positive("scale", scale, "the Laplace scale sets the privacy guarantee", "pass b > 0")
    if not secure:
        return Laplace(scale=b, sensitivity=sens)
    d = _coordinates(coordinates)
    return Laplace(scale=b, sensitivity=_secure_laplace_sensitivity(sens, b, lattice_spacing(b, float(d)), d))


def _coordinates(coordinates: int) -> int:
    if isinstance(coordinates, bool) or not isinstance(coordinates, (int, np.integer)) or coordinates < 1:
        raise InvalidParameterError(
            "coordinates", coordinates, "the secure lattice depends on the query's size", "pass an int ≥ 1"
        )
    return int(coordinates)


def laplace_noise(
    scale: float, size: int | tuple[int, ...], rng: RandomSource
) -> tuple[np.ndarray, float | None]:
    """``Lap(scale)`` noise of the given shape and the lattice it lies on (``None`` when seeded).

    Secure mode returns ``Λ·Z`` with ``Z`` exact discrete Laplace of scale ``scale/Λ`` and
    ``Λ = lattice_spacing(scale, n_coordinates)``; seeded mode returns float samples.
    """
    b = _positive("scale", scale, "the Laplace scale sets the privacy guarantee", "pass b > 0")
    rng = _check_rng(rng)
    shape = (size,) if isinstance(size, int) else tuple(size)
    if rng.secure:
        grid = lattice_spacing(b, float(max(1, math.prod(shape))))
        z = discrete_laplace_samples(Fraction(b) / Fraction(grid), shape, rng)
        return z.astype(np.float64) * grid, grid
    u = rng.uniform((2, *shape))
    e = -np.log1p(-u)  # Exp(1) from U ∈ [0, 1): 1 - U ∈ (0, 1], finite
    return b * (e[0] - e[1]), None


def laplace_mechanism(
    value: float | np.ndarray, *, sensitivity: float, scale: float, rng: RandomSource
) -> MechanismResult:
    """Release ``value + Lap(scale)`` (each coordinate) for a query of L1 sensitivity ``sensitivity``.

    Guarantee: pure ``ε = sensitivity/scale`` (seeded; see the module docstring for the float
    caveat) or ``ε = sensitivity_eff/scale`` with the lattice-corrected ``sensitivity_eff``
    (secure), under whichever neighbouring relation ``sensitivity`` was computed for. The event
    is a ``Laplace`` with that scale and (effective) sensitivity.
    """
    sens = _sensitivity(sensitivity, "L1")
    b = _positive(
        "scale", scale, "the Laplace scale sets the privacy guarantee", "pass b = laplace_scale(ε, Δ)"
    )
    rng = _check_rng(rng)
    x = _query_array(value)
    scalar = x.ndim == 0
    event = laplace_event(sens, b, coordinates=x.size, secure=rng.secure)
    if not rng.secure:
        noise, _ = laplace_noise(b, x.shape, rng)
        return MechanismResult(_wrap(x + noise, scalar), event, None)
    d = x.size
    grid = lattice_spacing(b, float(d))
    rounded = np.rint(x / grid)  # x/Λ is exact (Λ a power of two); round half to even
    if not np.all(np.isfinite(rounded)):
        raise InvalidParameterError(
            "value", "too large", "the answer overflows the secure lattice", "rescale the query"
        )
    z = discrete_laplace_samples(Fraction(b) / Fraction(grid), x.shape, rng)
    # rounded + z is the exact integer sum correctly rounded to float: a post-processing of it.
    out = (rounded + z.astype(np.float64)) * grid
    return MechanismResult(_wrap(out, scalar), event, grid)
