"""Noise mechanisms and randomness sources; each mechanism returns its result and its privacy event.

* :mod:`~veil.mechanisms.rng` — :class:`SeededSource` (reproducible research runs) and
  :class:`SecureSource` (OS CSPRNG, floating-point hardened), chosen by :func:`make_source`.
* :mod:`~veil.mechanisms.laplace` / :mod:`~veil.mechanisms.gaussian` — Laplace (L1 sensitivity)
  and Gaussian (L2 sensitivity) mechanisms; classic and analytic Gaussian calibration.
* :mod:`~veil.mechanisms.discrete` — exact integer samplers: Bernoulli(exp(−γ)), discrete Laplace,
  discrete Gaussian (Canonne, Kamath & Steinke 2020).
* :mod:`~veil.mechanisms.noisy_max` — report-noisy-max (LNMax, GNMax) for PATE.

Guarantees, neighbouring relations and the secure-mode analysis: ``docs/mechanisms.md``.
Importing this package does not import torch or scipy.
"""

from __future__ import annotations

from veil.mechanisms.discrete import (
    discrete_gaussian_samples,
    discrete_laplace_samples,
    sample_bernoulli_exp,
    sample_discrete_gaussian,
    sample_discrete_laplace,
)
from veil.mechanisms.gaussian import (
    gaussian_delta,
    gaussian_event,
    gaussian_mechanism,
    gaussian_std_analytic,
    gaussian_std_classic,
)
from veil.mechanisms.laplace import (
    GRID_BITS,
    MechanismResult,
    laplace_event,
    laplace_mechanism,
    laplace_noise,
    laplace_scale,
    lattice_spacing,
)
from veil.mechanisms.noisy_max import (
    NoiseKind,
    NoisyMaxResult,
    dominating_laplace_epsilon,
    noisy_max_event,
    report_noisy_max,
)
from veil.mechanisms.rng import RandomSource, SecureSource, SeededSource, make_source

__all__ = [
    "GRID_BITS",
    "MechanismResult",
    "NoiseKind",
    "NoisyMaxResult",
    "RandomSource",
    "SecureSource",
    "SeededSource",
    "discrete_gaussian_samples",
    "discrete_laplace_samples",
    "dominating_laplace_epsilon",
    "gaussian_delta",
    "gaussian_event",
    "gaussian_mechanism",
    "gaussian_std_analytic",
    "gaussian_std_classic",
    "laplace_event",
    "laplace_mechanism",
    "laplace_noise",
    "laplace_scale",
    "lattice_spacing",
    "make_source",
    "noisy_max_event",
    "report_noisy_max",
    "sample_bernoulli_exp",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
]
