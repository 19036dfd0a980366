"""Privacy analysis of PATE aggregation: data-independent and data-dependent Rényi-DP bounds.

Neighbouring relation. Teachers are trained on disjoint partitions (:mod:`veil.pate.partition`),
so adding or removing one private record (or one group, when groups are given) changes one
teacher, whose vote on every query may change: in each vote histogram one count goes down by one
and another up by one. All bounds below are per query under that relation and compose by
addition over the queries asked (Rényi DP).

Data-independent bounds (they hold for every dataset):

* GNMax with std σ: the vote vector has L2 sensitivity √2, so the answer is ``(α, α/σ²)``-RDP;
  in general ``α/(2z²)`` with ``z`` the noise multiplier of
  :func:`veil.mechanisms.noisy_max_event` (which carries the secure-lattice correction).
* The threshold check of Confident-GNMax adds ``N(0, σ₁²)`` to the top count (sensitivity 1):
  ``α/(2z₁²)``, ``z₁ = σ₁`` in seeded mode.
* LNMax is accounted by its event (pure ε per answer), see :mod:`veil.mechanisms.noisy_max`.

Data-dependent bound (Papernot et al. 2018, "Scalable Private Learning with PATE", ICLR,
Proposition 7 and Theorem 6). For the actual dataset ``D`` and a likely outcome ``i*``:

* Prop. 7: ``q = Pr[GNMax(D) ≠ i*] ≤ q̃ = Σ_{j≠i*} Pr[N(0, 2σ²) ≥ n_{i*} − n_j]`` (union bound;
  ``i*`` = the plurality class). In secure mode the exact discrete noise is stochastically within
  ``±3Λ/2`` of a continuous Gaussian, so the gaps are reduced by ``3Λ``.
* Thm. 6: if the mechanism is ``(μ₁, ε₁)``- and ``(μ₂, ε₂)``-RDP (here ``ε(μ) = μ/(2z²)``), with
  ``1 < λ < μ₁``, ``μ₂ > 1`` and ``q̃`` small enough, then for every neighbour ``D'``
  ``D_λ(M(D)‖M(D')) ≤ log((1−q̃)·A^{λ−1} + q̃·B^{λ−1})/(λ−1)`` with
  ``A = (1−q̃)/(1 − (q̃e^{ε₂})^{(μ₂−1)/μ₂})`` and ``B = e^{ε₁}/q̃^{1/(μ₁−1)}``.

  The bound is proven at the *true* q; using an upper bound ``q̃`` needs the bound to be
  non-decreasing on ``[0, q̃]``. Besides the paper's condition
  ``q̃ ≤ e^{(μ₂−1)ε₂}/(μ₁/(μ₁−1) · μ₂/(μ₂−1))^{μ₂}`` and ``q̃e^{ε₂} < 1`` (so ``A > 0``), this
  module checks monotonicity *exactly*: the ``B`` term always increases with q (``λ < μ₁``), and
  the ``A`` term increases on ``(0, q̃]`` iff ``h ≥ 0`` there, where
  ``h(q) = (λ−1)γu(1−q)/q − λ(1−u)``, ``u = (qe^{ε₂})^γ``, ``γ = (μ₂−1)/μ₂``; ``h`` decreases
  then increases (its minimum is at ``q_c = (λ−1)(1−γ)/(1 + (λ−1)(1−γ))``), so checking
  ``h(min(q̃, q_c)) ≥ 0`` suffices. The higher orders ``(μ₁, μ₂) = (μ+1, μ)`` range over a fixed,
  data-independent grid :data:`MU_GRID`; the bound used is the smallest valid one, capped by the
  data-independent bound. Since each candidate is non-decreasing on its validity range and the
  validity ranges are intervals ``[0, q_max(μ)]``, the result is a non-decreasing function of
  ``q̃`` — the property the smooth-sensitivity analysis relies on.
* The threshold check (Confident-GNMax) is a Gaussian mechanism whose output is one bit; its
  likely outcome is the more probable of "answer"/"no answer", ``q = min(p, 1 − p)`` with
  ``p = Pr[n_max + N(0, σ₁²) ≥ T]`` computed exactly (with ``±3Λ/2`` slack in secure mode).

A data-dependent bound is a statement about the actual dataset: it is itself a function of the
private data. :mod:`veil.pate.smooth_sensitivity` releases it privately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from veil.errors import InvalidParameterError

__all__ = [
    "MU_GRID",
    "data_dependent_rdp",
    "data_independent_rdp",
    "log_q_noisy_max",
    "log_q_sorted_gaps",
    "log_q_threshold",
]

# Candidate higher orders μ₂ (μ₁ = μ₂ + 1) for Theorem 6: fixed and data-independent, geometric
# with ratio ≈ 1.2 from 1.05 to 2·10⁴ (the bound varies smoothly in μ, so a denser grid gains little).
MU_GRID: np.ndarray = np.geomspace(1.05, 2.0e4, 56)


def _positive(name: str, value: float, why: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidParameterError(name, value, why, f"pass {name} > 0")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise InvalidParameterError(name, value, why, f"pass a finite {name} > 0")
    return float(value)


def _order(order: float) -> float:
    if isinstance(order, bool) or not isinstance(order, (int, float, np.floating, np.integer)):
        raise InvalidParameterError("order", order, "a Rényi order is a number > 1", "pass λ > 1")
    lam = float(order)
    if not (lam > 1 and math.isfinite(lam)):
        raise InvalidParameterError(
            "order", order, "Rényi DP is analysed at finite orders λ > 1", "pass λ > 1"
        )
    return lam


def _log_sf_normal(x: np.ndarray, std: float) -> np.ndarray:
    """``log Pr[N(0, std²) ≥ x]``, accurate deep into both tails."""
    from scipy.special import log_ndtr

    return np.asarray(log_ndtr(-np.asarray(x, dtype=np.float64) / std))


def _log1mexp(x: np.ndarray) -> np.ndarray:
    """``log(1 − eˣ)`` for ``x ≤ 0`` (−inf at 0), stable for x near 0 and very negative x."""
    x = np.minimum(np.asarray(x, dtype=np.float64), 0.0)
    with np.errstate(divide="ignore"):
        return np.where(x > -0.6931471805599453, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def log_q_sorted_gaps(gaps: np.ndarray, sigma: float, lattice: float = 0.0) -> np.ndarray:
    """Prop. 7 from gaps ``n_{i*} − n_j ≥ 0`` (last axis: the classes other than ``i*``), capped at 0.

    ``log Σ_j Pr[N(0, 2σ²) ≥ gap_j − 3Λ]``: the ``lattice`` Λ (secure mode) lowers each gap by
    ``3Λ``.
    """
    g = np.asarray(gaps, dtype=np.float64) - 3.0 * lattice
    terms = _log_sf_normal(g, math.sqrt(2.0) * sigma)
    from scipy.special import logsumexp

    return np.minimum(np.asarray(logsumexp(terms, axis=-1)), 0.0)


def log_q_noisy_max(counts: Sequence[int] | np.ndarray, sigma: float, lattice: float = 0.0) -> np.ndarray:
    """``log q̃`` of Prop. 7 for one histogram (1-D) or one per row (2-D), ``i*`` = plurality class.

    ``q̃ ≥ Pr[argmax_j(n_j + N(0, σ²)) ≠ i*]`` (smallest index on ties, secure lattice included when
    ``lattice`` > 0).
    """
    sigma = _positive("sigma", sigma, "the GNMax noise std sets the bound")
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim not in (1, 2) or c.shape[-1] < 2:
        raise InvalidParameterError(
            "counts", c.shape, "Prop. 7 needs at least two classes", "pass one count per class"
        )
    s = -np.sort(-c, axis=-1)
    gaps = s[..., :1] - s[..., 1:]
    return log_q_sorted_gaps(gaps, sigma, lattice)


def log_q_threshold(
    max_count: float | np.ndarray, threshold: float, sigma1: float, lattice: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """``(log q̃, log p)`` of the threshold check: ``p = Pr[n_max + N(0, σ₁²) ≥ T]`` and
    ``q̃ = min(p⁺, 1 − p⁻)``, where ``p^±`` shift the comparison by ``±3Λ/2`` (secure mode; Λ = 0
    otherwise, so ``q̃ = min(p, 1 − p)``).
    """
    sigma1 = _positive("sigma1", sigma1, "the threshold noise std sets the bound")
    m = np.asarray(max_count, dtype=np.float64)
    log_p_hi = _log_sf_normal(threshold - m - 1.5 * lattice, sigma1)
    log_p_lo = _log_sf_normal(threshold - m + 1.5 * lattice, sigma1)
    log_1m_p_lo = _log_sf_normal(m - 1.5 * lattice - threshold, sigma1)  # Pr[N < T − m + 1.5Λ]
    return np.minimum(log_p_hi, log_1m_p_lo), log_p_lo


def data_independent_rdp(noise_multiplier: float, orders: Sequence[float] | np.ndarray | float) -> np.ndarray:
    """``α/(2z²)``: the RDP of one Gaussian answer with noise multiplier ``z`` (σ over sensitivity)."""
    z = _positive("noise_multiplier", noise_multiplier, "the noise multiplier sets the bound")
    return np.asarray(orders, dtype=np.float64) / (2.0 * z * z)


def data_dependent_rdp(log_q: np.ndarray | float, noise_multiplier: float, order: float) -> np.ndarray:
    """Theorem 6 at order ``λ`` for each ``log q̃`` (any shape), capped by the data-independent bound.

    ``noise_multiplier`` ``z`` is that of the mechanism's event (``σ/√2`` for GNMax, ``σ₁`` for the
    threshold check), so ``ε(μ) = μ/(2z²)``. Non-decreasing in ``q̃``; 0 where ``q̃ = 0``.
    """
    lam = _order(order)
    z = _positive("noise_multiplier", noise_multiplier, "the noise multiplier sets the bound")
    v = 2.0 * z * z
    di = lam / v
    lq = np.asarray(log_q, dtype=np.float64)
    if np.any(lq > 0) or np.any(np.isnan(lq)):
        raise InvalidParameterError("log_q", "> 0", "q̃ is a probability bound", "pass log q̃ ≤ 0")
    flat = lq.reshape(-1)
    out = np.full(flat.shape, di)
    out[np.isneginf(flat)] = 0.0
    live = np.isfinite(flat)
    if np.any(live):
        out[live] = np.minimum(di, _theorem6(flat[live], v, lam))
    return out.reshape(lq.shape)


def _theorem6_candidates(
    log_q: np.ndarray, v: float, lam: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Theorem-6 bounds for each ``log q̃`` (rows) and candidate ``μ₂`` in :data:`MU_GRID` (columns).

    Returns ``(mu2, bound, valid)``; ``valid`` marks where every condition of the module docstring
    holds (then the bound is non-decreasing on ``(0, q̃]``).
    """
    mu2 = MU_GRID[lam < MU_GRID + 1.0][None, :]
    mu1 = mu2 + 1.0
    eps1, eps2 = mu1 / v, mu2 / v
    gamma = (mu2 - 1.0) / mu2
    lq = np.asarray(log_q, dtype=np.float64)[:, None]
    log1mq = _log1mexp(lq)
    # Paper's condition and A > 0 (q̃·e^{ε₂} < 1).
    paper = lq <= (mu2 - 1.0) * eps2 - mu2 * (np.log(mu1 / (mu1 - 1.0)) + np.log(mu2 / (mu2 - 1.0)))
    a_pos = lq + eps2 < 0
    # Monotonicity of the A term on (0, q̃]: h(min(q̃, q_c)) ≥ 0 (see the module docstring).
    c = (lam - 1.0) * (1.0 - gamma)
    log_qc = np.log(c / (1.0 + c))
    lh = np.minimum(lq, log_qc)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_u_h = gamma * (lh + eps2)
        lhs = log_u_h + np.logaddexp(np.log((lam - 1.0) * gamma) + _log1mexp(lh) - lh, math.log(lam))
        mono = lhs >= math.log(lam) + 1e-12
        log_u = gamma * (lq + eps2)
        log_t1 = log1mq + (lam - 1.0) * (log1mq - _log1mexp(log_u))
        log_t2 = lq + (lam - 1.0) * (eps1 - lq / (mu1 - 1.0))
        bound = np.logaddexp(log_t1, log_t2) / (lam - 1.0)
    valid = paper & a_pos & mono & np.isfinite(bound)
    return mu2[0], np.maximum(np.where(np.isfinite(bound), bound, np.inf), 0.0), valid


def _theorem6(log_q: np.ndarray, v: float, lam: float) -> np.ndarray:
    """Smallest valid Theorem-6 bound over :data:`MU_GRID` for each ``log q̃`` (inf if none is valid)."""
    mu2, bound, valid = _theorem6_candidates(log_q, v, lam)
    if mu2.size == 0:
        return np.full(np.shape(log_q), np.inf)
    best = np.min(np.where(valid, bound, np.inf), axis=1)
    # Round up a little: the log-space arithmetic is accurate to ~1e-15 relative.
    return np.asarray(best * (1.0 + 1e-12) + 1e-300)
