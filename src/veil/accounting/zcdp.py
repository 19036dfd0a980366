"""zCDP budgets: the ρ that a target (ε, δ) allows, and the ε of a ρ, through the RDP conversion.

A mechanism is ρ-zCDP when its Rényi divergence of every order α > 1 is at most ``α·ρ`` (Bun &
Steinke 2016). Gaussian releases (``1/(2σ²)``) and exponential-mechanism selections (``ε²/8``) are
both zCDP and compose by adding ρ, which is how synthetic-data mechanisms (MST, AIM) split a budget.
The conversion to (ε, δ) is the RDP accountant's (:func:`veil.accounting.rdp.rdp_to_epsilon`, the
conversion of Canonne, Kamath & Steinke 2020) over its grid of orders, so a ρ planned here and the
events accounted later by :class:`~veil.accounting.rdp.RDPAccountant` give the same ε.
"""

from __future__ import annotations

import math

import numpy as np

from veil.accounting.interface import check_delta, check_epsilon
from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from veil.errors import InvalidParameterError

__all__ = ["epsilon_of_rho", "rho_for_epsilon"]


def epsilon_of_rho(rho: float, delta: float) -> float:
    """The (ε, δ) guarantee of a ρ-zCDP mechanism, ε for the given δ (0 for ρ = 0)."""
    delta = check_delta(delta)
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho >= 0):
        raise InvalidParameterError("rho", rho, "a zCDP budget is a finite number ≥ 0", "pass ρ ≥ 0")
    if rho == 0:
        return 0.0
    return rdp_to_epsilon(DEFAULT_ORDERS, np.asarray(DEFAULT_ORDERS) * rho, delta)


def rho_for_epsilon(epsilon: float, delta: float) -> float:
    """The largest ρ (to a relative 1e-9, rounded down) whose ε at ``delta`` is at most ``epsilon``."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if epsilon == 0:
        raise InvalidParameterError("epsilon", epsilon, "ε = 0 allows no release of the data", "pass ε > 0")
    lo, hi = 0.0, max(1.0, epsilon)
    while epsilon_of_rho(hi, delta) <= epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if epsilon_of_rho(mid, delta) <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo
