"""Opacus's ``opacus.accountants`` names, mapped onto veil's accountants (no torch imported).

* :class:`RDPAccountant` and :class:`PRVAccountant` are veil's RDP and PLD accountants (Opacus's PRV
  accountant and veil's PLD accountant compute the same privacy loss distribution) with Opacus's
  ``step(noise_multiplier=, sample_rate=)``. Every veil accountant answers ``get_epsilon(delta)`` and
  ``history``.
* :func:`create_accountant` takes Opacus's names (``"prv"``, ``"rdp"``; ``"gdp"`` is refused).
* :mod:`veil.accountants.utils` holds ``get_noise_multiplier``.
"""

from __future__ import annotations

from veil.accounting.base import PrivacyAccountant, make_accountant
from veil.accounting.calibrate import dpsgd_event
from veil.accounting.events import NonPrivate
from veil.accounting.history import HistoryEntry, dpsgd_history
from veil.accounting.pld import PLDAccountant
from veil.accounting.rdp import RDPAccountant as _VeilRDP

__all__ = ["HistoryEntry", "PRVAccountant", "RDPAccountant", "create_accountant", "dpsgd_history"]


class _OpacusStep:
    """Opacus's ``accountant.step(noise_multiplier=σ, sample_rate=q)``: one DP-SGD step composed."""

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Compose one Poisson-sampled Gaussian step (``NonPrivate`` when σ = 0, so ε becomes ∞)."""
        assert isinstance(self, PrivacyAccountant)
        event = NonPrivate() if noise_multiplier == 0 else dpsgd_event(sample_rate, noise_multiplier)
        self.compose(event)

    def __len__(self) -> int:
        assert isinstance(self, PrivacyAccountant)
        return len(self.history)


class RDPAccountant(_OpacusStep, _VeilRDP):
    """veil's RDP accountant under Opacus's name, with ``step``; ε from the tight RDP→(ε, δ) conversion."""


class PRVAccountant(_OpacusStep, PLDAccountant):
    """veil's PLD accountant (pessimistic rounding) under Opacus's ``PRVAccountant`` name, with ``step``."""


def create_accountant(mechanism: str) -> PrivacyAccountant:
    """Opacus's factory: ``"prv"`` → :class:`PRVAccountant`, ``"rdp"`` → :class:`RDPAccountant`."""
    from veil.compat.opacus_args import resolve_accountant

    name = resolve_accountant(mechanism)
    if name == "pld":
        return PRVAccountant()
    if name == "rdp":
        return RDPAccountant()
    return make_accountant(name)  # refuses unknown names with veil's message
