"""The two private operations of MST and AIM: Gaussian measurement of a marginal and a selection.

Neighbouring relation: add or remove one row (one record is one row of the table). A marginal's
count table then changes in one cell by one: L2 sensitivity 1. Measuring it releases
``counts + N(0, σ²)`` per cell through :func:`veil.mechanisms.gaussian.gaussian_mechanism` (secure
mode: exact discrete Gaussian on a lattice, its event corrected for the lattice), event
``Gaussian(σ_eff)`` with ``σ_eff ≥`` the planned noise multiplier, hence zCDP ``ρ = 1/(2σ_eff²)``.
A selection is one draw of :func:`veil.mechanisms.exponential.exponential_mechanism` with a score
whose sensitivity the caller states, event ``ExponentialMechanism(ε)``, zCDP ``ε²/8``.

:class:`Spend` records every event as it happens, with what it touched; the run's (ε, δ) is the RDP
accountant's composition of exactly these events.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from veil.accounting.events import ExponentialMechanism, Gaussian, PrivacyEvent
from veil.mechanisms.exponential import exponential_mechanism
from veil.mechanisms.gaussian import gaussian_event, gaussian_mechanism
from veil.mechanisms.rng import RandomSource
from veil.synth.junction import Clique
from veil.synth.pgm import Measurement, marginal_counts

__all__ = ["Spend", "event_rho", "l1", "measure", "select", "std_for"]


def event_rho(event: PrivacyEvent) -> float:
    """The zCDP ρ of a measurement or selection event."""
    if isinstance(event, Gaussian):
        return 1.0 / (2.0 * event.noise_multiplier**2)
    if isinstance(event, ExponentialMechanism):
        return event.rho
    raise TypeError(type(event).__name__)


def std_for(multiplier: float, cells: int, secure: bool) -> float:
    """The noise std whose event (lattice-corrected in secure mode) has at least ``multiplier``."""
    std = multiplier
    while gaussian_event(1.0, std, coordinates=cells, secure=secure).noise_multiplier < multiplier:
        got = gaussian_event(1.0, std, coordinates=cells, secure=secure).noise_multiplier
        std *= (multiplier / got) * (1 + 1e-12)
    return std


def l1(a: np.ndarray, b: np.ndarray) -> float:
    """Σ|a − b| summed exactly rounded (math.fsum), as the selection's float margin assumes."""
    return math.fsum(np.abs(np.ravel(a) - np.ravel(b)).tolist())


@dataclass
class Spend:
    """The events of one run, in order, with a label each (which marginal, which selection)."""

    rho_budget: float
    on_event: Callable[[str, PrivacyEvent], None] | None = None
    """Called with each event as it is released (the run's ledger append)."""
    events: list[tuple[str, PrivacyEvent]] = field(default_factory=list)

    @property
    def rho(self) -> float:
        return sum(event_rho(e) for _, e in self.events)

    @property
    def remaining(self) -> float:
        return self.rho_budget - self.rho

    def add(self, label: str, event: PrivacyEvent) -> None:
        if self.on_event is not None:
            self.on_event(label, event)
        self.events.append((label, event))


def measure(
    codes: np.ndarray,
    sizes: Sequence[int],
    attrs: Clique,
    multiplier: float,
    rng: RandomSource,
    spend: Spend,
    names: Sequence[str],
    weights: np.ndarray | None = None,
) -> Measurement:
    """Release the marginal of ``attrs`` with Gaussian noise of (at least) ``multiplier``; record it.

    ``weights`` (privacy units): each row's weight in the counts; a unit's weights sum to at most 1,
    so the L2 sensitivity stays 1 under add/remove one unit."""
    counts = marginal_counts(codes, sizes, attrs, weights)
    std = std_for(multiplier, counts.size, rng.secure)
    result = gaussian_mechanism(counts.ravel(), sensitivity=1.0, std=std, rng=rng)
    spend.add("measure " + " × ".join(names[a] for a in attrs), result.event)
    y = np.asarray(result.value, dtype=np.float64).reshape(counts.shape)
    return Measurement(attrs, y, np.full(counts.shape, 1.0 / std**2), std)


def select(
    scores: Sequence[float],
    epsilon: float,
    sensitivity: float,
    rng: RandomSource,
    spend: Spend,
    label: str,
) -> int:
    """One exponential-mechanism selection among ``scores``; records its event."""
    index, event = exponential_mechanism(np.asarray(scores, dtype=np.float64), epsilon, sensitivity, rng)
    spend.add(label, event)
    return index
