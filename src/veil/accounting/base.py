"""Accountants by name: :func:`make_accountant`, and the interface every accountant implements.

The interface (:class:`PrivacyAccountant` and its contract) lives in
:mod:`veil.accounting.interface`, which the accountants import; this module sits above them, so the
accountants never import it back (no import circle).
"""

from __future__ import annotations

from veil.accounting.events import Neighbouring
from veil.accounting.interface import (
    ACCOUNTANTS,
    AccountantName,
    PrivacyAccountant,
    check_delta,
    check_epsilon,
)
from veil.errors import InvalidParameterError

__all__ = [
    "ACCOUNTANTS",
    "AccountantName",
    "PrivacyAccountant",
    "check_delta",
    "check_epsilon",
    "make_accountant",
]


def make_accountant(
    name: AccountantName = "pld", neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE
) -> PrivacyAccountant:
    """A fresh accountant by name: ``"pld"`` (default, tightest) or ``"rdp"``."""
    if name == "pld":
        from veil.accounting.pld import PLDAccountant

        return PLDAccountant(neighbouring)
    if name == "rdp":
        from veil.accounting.rdp import RDPAccountant

        return RDPAccountant(neighbouring)
    raise InvalidParameterError(
        "accountant", name, "only known accountants give a checked bound", f"use one of {list(ACCOUNTANTS)}"
    )
