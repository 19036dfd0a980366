"""Propose-Test-Release: turning the data-dependent PATE analysis into an (ε, δ)-DP guarantee.

The data-dependent RDP of Papernot et al. (2018, Thm. 6; :mod:`veil.pate.analysis`) holds for the
actual dataset only. Propose-Test-Release (Dwork & Lei 2009; for data-dependent RDP, Redberg, Zhu
& Wang, "Generalized PTR", AISTATS 2023) *tests privately* that the dataset is far from any
dataset where that bound would exceed a proposed value ``B``, and releases the labels only if it
is. The result is a worst-case (ε, δ)-DP guarantee.

Mechanism (``budget="ptr"``). All parameters are public and fixed before any vote is seen.

1. Selection. GNMax: the queries are the first ``Q`` of the public pool (order fixed by seed).
   Confident-GNMax: the first ``n`` queries are checked, ``max_j n_j + N(0, σ₁²) ≥ T`` (top count:
   sensitivity 1), each check accounted *data-independently*, ``(α, α/(2σ₁²))``-RDP; the set ``S``
   of selected queries is a post-processing of the checks, hence ``(ε₁, δ₁)``-DP (RDP converted;
   ``n`` is the largest number of checks with ``ε₁ ≤ select_share·ε``). At most ``max_answers`` of
   ``S`` (in order) are kept. Both steps depend on the data only through the DP checks.
2. Test. For the selected histograms let ``U_k(h) = F(q̃(max(g − 2k, 0)))``, with ``g`` the sorted
   gaps ``s₁ − s_j`` of ``h``, ``q̃`` Prop. 7 and ``F`` the Thm-6 bound at order λ
   (:func:`~veil.pate.analysis.data_dependent_rdp`, non-decreasing in q̃), and
   ``F_k(D) = Σ_{i∈S} U_k(h_i)``. ``F_0(D)`` is the data-dependent RDP of the GNMax answers on S.
   ``d̂(D) = min{k : F_k(D) > B}`` (∞ if none). Release ``d̂ + Z``, Z discrete Laplace of scale
   ``t = 1/ε_t``; pass iff it is ``≥ τ``, ``τ = 1 + ⌈t·ln(1/(δ_t(1 + e^{−1/t})))⌉``. Only pass/fail
   is published (never d̂).
3. Release. Pass: the GNMax(σ) answers on S. Fail: no label at all.

Proof sketch.

* ``U_k`` bounds ``F(q̃)`` over every histogram reachable by changing k teachers' votes: each count
  moves by at most k, so each order statistic does too, and every sorted gap is ≥ ``g_j − 2k``;
  q̃ decreases in every gap and F is non-decreasing in q̃ (the bound is a relaxation of the exact
  maximum; ``tests/test_pate_ptr.py`` checks it against brute force).
* Nesting. A neighbour D' (one record added/removed = one teacher changed, arbitrarily on every
  query) has every sorted gap within ±2 of D's, so ``max(g' − 2k, 0) ≥ max(g − 2(k+1), 0)`` and
  ``F_k(D') ≤ F_{k+1}(D)``, and symmetrically. Hence ``|d̂(D) − d̂(D')| ≤ 1``: the discrete
  Laplace release of d̂ is ``ε_t``-DP, and so is the pass/fail bit.
* If ``d̂(D) ≤ 1`` the pass probability is ``≤ Pr[Z ≥ τ − 1] = e^{−(τ−1)/t}/(1 + e^{−1/t}) ≤ δ_t``.
* If ``d̂(D) ≥ 2`` then ``F_1(D) ≤ B``, so for every neighbour D':
  ``D_λ(M(D)‖M(D')) ≤ F_0(D) ≤ B`` (Thm. 6 at D, summed over the independent answers) and
  ``D_λ(M(D')‖M(D)) ≤ F_0(D') ≤ F_1(D) ≤ B`` (Thm. 6 at D'). The RDP→DP conversion (valid for one
  pair of distributions) gives ``(ε_p, δ_p)`` in both directions, ``ε_p = ε(λ, B, δ_p)``.
* Test + release is then ``(ε_t + ε_p, e^{ε_t}δ_p + δ_t)``-DP: split any event into fail/pass;
  the fail part changes by ≤ e^{ε_t}; the pass part by ≤ e^{ε_t}(e^{ε_p}P + δ_p) when
  ``d̂(D) ≥ 2`` and is ≤ δ_t otherwise.
* With the selection (adaptive basic composition): ``ε = ε₁ + ε_t + ε_p``,
  ``δ = δ₁ + e^{ε_t}δ_p + δ_t``.

Public defaults (:func:`plan_ptr`): ``ε_t = test_share·ε`` (0.1ε); δ split ``δ₁ = δ_t = δ/4`` and
``e^{ε_t}δ_p = δ/2`` (GNMax: ``δ₁ = 0``, ``δ_t = δ/2``); ``ε_p = ε − ε₁ − ε_t``;
``λ = 1 + 2·ln(1/δ_p)/ε_p`` (half of ε_p to the conversion), rounded to ½; ``B`` the largest RDP
with ``ε(λ, B, δ_p) ≤ ε_p``. A failed test still spends the whole ε.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from veil.errors import InvalidParameterError, UnreachableTargetError
from veil.mechanisms.discrete import sample_discrete_laplace
from veil.mechanisms.rng import RandomSource
from veil.pate.analysis import data_dependent_rdp, log_q_sorted_gaps

__all__ = [
    "PtrPlan",
    "plan_ptr",
    "ptr_bound_at_distance",
    "ptr_distance",
    "ptr_test",
    "sorted_gaps",
]

_ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)


def _conv(rdp: np.ndarray, delta: float) -> float:
    return rdp_to_epsilon(DEFAULT_ORDERS, rdp, delta)


@dataclass(frozen=True)
class PtrPlan:
    """Every public parameter of one PTR run and the (ε, δ) it guarantees."""

    checks: int
    """Confident-GNMax: threshold checks run (the selection); GNMax: 0 (the queries are fixed)."""
    eps_select: float
    delta_select: float
    eps_test: float
    delta_test: float
    laplace_scale: float
    """``t``: the test noise is discrete Laplace ``Pr[z] ∝ e^{−|z|/t}``, ``ε_t = 1/t``."""
    tau: int
    order: float
    bound: float
    """``B``: the proposed data-dependent RDP at order λ."""
    eps_release: float
    delta_release: float
    epsilon: float
    delta: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unreachable(epsilon: float, why: str) -> UnreachableTargetError:
    return UnreachableTargetError(
        "epsilon",
        epsilon,
        f"the PTR budget cannot be split ({why})",
        "raise ε, lower ptr_select_share/ptr_test_share, or use the data-independent budget",
    )


def plan_ptr(
    epsilon: float,
    delta: float,
    *,
    threshold_rho: float | None,
    available_queries: int,
    test_share: float = 0.1,
    select_share: float = 0.3,
    order: float | None = None,
) -> PtrPlan:
    """The PTR plan from public settings only (see the module docstring for the defaults).

    ``threshold_rho``: ``1/(2z₁²)`` of one threshold check (Confident-GNMax), ``None`` for GNMax.
    """
    for name, v in (("ptr_test_share", test_share), ("ptr_select_share", select_share)):
        if not (isinstance(v, (int, float)) and 0 < v < 1):
            raise InvalidParameterError(name, v, "a share of the target ε", "pass a number in (0, 1)")
    if threshold_rho is not None and test_share + select_share >= 1:
        raise InvalidParameterError(
            "ptr_select_share", select_share, "selection and test would use the whole ε", "lower them"
        )
    confident = threshold_rho is not None
    d_sel = delta / 4 if confident else 0.0
    d_test = delta / 4 if confident else delta / 2
    checks, eps_sel = 0, 0.0
    if confident:
        assert threshold_rho is not None
        cap = select_share * epsilon

        def fits(n: int) -> bool:
            return _conv(_ORDERS * n * threshold_rho, d_sel) <= cap

        lo, hi = 0, int(available_queries)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        checks = lo
        if checks == 0:
            raise _unreachable(epsilon, f"not one threshold check fits ε₁ ≤ {cap:.3g}")
        eps_sel = _conv(_ORDERS * checks * threshold_rho, d_sel)
    t = Fraction(1.0 / (test_share * epsilon)).limit_denominator(10**6)
    eps_t = math.nextafter(float(1 / t), math.inf)  # ε_t = 1/t, rounded up
    t_f = float(t)
    # Pr[Z ≥ n] = e^{−n/t}/(1 + e^{−1/t}) for n ≥ 1: τ − 1 is the smallest n making it ≤ δ_t.
    tau = 1 + math.ceil(t_f * math.log(1.0 / (d_test * (1.0 + math.exp(-1.0 / t_f)))) * (1 + 1e-12))
    d_rel = (delta - d_sel - d_test) / math.exp(eps_t) * (1.0 - 1e-12)
    eps_p = epsilon - eps_sel - eps_t
    if eps_p <= 0:
        raise _unreachable(epsilon, "nothing is left for the release")
    lam = (
        order if order is not None else max(2.0, round(2.0 * (1.0 + 2.0 * math.log(1.0 / d_rel) / eps_p)) / 2)
    )
    if not (lam > 1 and math.isfinite(lam)):
        raise InvalidParameterError("ptr_order", order, "Rényi orders are > 1", "pass λ > 1")
    # ε(λ, B, δ) = B + ln(1 − 1/λ) − (ln δ + ln λ)/(λ − 1) (the conversion of rdp_to_epsilon).
    b = eps_p - math.log1p(-1.0 / lam) + (math.log(d_rel) + math.log(lam)) / (lam - 1.0)
    b = math.nextafter(b, 0.0)
    if b <= 0:
        raise _unreachable(epsilon, f"at order λ={lam:g} the conversion alone exceeds ε_p={eps_p:.3g}")
    eps_rel = rdp_to_epsilon([lam], [b], d_rel)
    return PtrPlan(
        checks=checks,
        eps_select=eps_sel,
        delta_select=d_sel,
        eps_test=eps_t,
        delta_test=d_test,
        laplace_scale=t_f,
        tau=int(tau),
        order=float(lam),
        bound=float(b),
        eps_release=eps_rel,
        delta_release=d_rel,
        epsilon=eps_sel + eps_t + eps_rel,
        delta=d_sel + math.exp(eps_t) * d_rel + d_test,
    )


def sorted_gaps(histograms: np.ndarray) -> np.ndarray:
    """``s₁ − s_j`` (j = 2..C) of each histogram's sorted counts, shape ``(m, C − 1)``."""
    h = np.asarray(histograms, dtype=np.int64)
    s = -np.sort(-h, axis=1)
    return s[:, :1] - s[:, 1:]


def ptr_bound_at_distance(
    gaps: np.ndarray, k: int, sigma: float, noise_multiplier: float, order: float, lattice: float = 0.0
) -> float:
    """``F_k = Σ_i F(q̃(max(g_i − 2k, 0)))``: the data-dependent RDP at order λ of GNMax answers on
    every histogram within k changed teachers of these (sorted gaps ``g``), summed over queries."""
    g = np.maximum(np.asarray(gaps, dtype=np.float64) - 2.0 * k, 0.0)
    if g.shape[0] == 0:
        return 0.0
    lq = log_q_sorted_gaps(g, sigma, lattice)
    return float(np.sum(data_dependent_rdp(lq, noise_multiplier, order)))


def ptr_distance(
    gaps: np.ndarray,
    bound: float,
    num_teachers: int,
    sigma: float,
    noise_multiplier: float,
    order: float,
    lattice: float = 0.0,
) -> float:
    """``d̂ = min{k ≥ 0 : F_k > B}`` (``inf`` if ``F_k ≤ B`` for all k). Private: never publish it.

    ``F_k`` is non-decreasing in k and constant once ``2k ≥ K`` (all gaps 0), so a bisection over
    ``0..⌈K/2⌉`` finds it.
    """

    def over(k: int) -> bool:
        return ptr_bound_at_distance(gaps, k, sigma, noise_multiplier, order, lattice) > bound

    top = (int(num_teachers) + 1) // 2
    if not over(top):
        return math.inf
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) else (mid + 1, hi)
    return float(lo)


def ptr_test(distance: float, plan: PtrPlan, rng: RandomSource) -> bool:
    """The private test: ``d̂ + Z ≥ τ`` with Z discrete Laplace of scale ``t`` (ε_t-DP, d̂ has
    sensitivity 1). Returns only the pass/fail bit."""
    if math.isinf(distance):  # F_k ≤ B for every k: a public fact (|S|·cap ≤ B), passes for all D
        return True
    t = Fraction(plan.laplace_scale).limit_denominator(10**6)
    z = sample_discrete_laplace(t, rng)
    return int(distance) + int(z) >= plan.tau
