"""Opacus's ``accountant.history`` view of a veil ledger: runs of ``(noise_multiplier, sample_rate, steps)``.

A read-only view computed from the composed events; the ledger stays the record. A DP-SGD step is
``PoissonSampled(q, Gaussian(σ))`` → ``(σ, q)``, or ``Gaussian(σ)`` → ``(σ, 1.0)`` (no sampling, e.g.
the shuffled loader's ``σ/2`` steps, shown as accounted); a non-private step is ``(0.0, 1.0)``.
Consecutive equal steps merge into one entry, as Opacus's accountants record them. Any other event
(Laplace, PATE answers, ...) has no such form and is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from veil.accounting.events import (
    Composed,
    Gaussian,
    NonPrivate,
    NoOp,
    PoissonSampled,
    PrivacyEvent,
    SelfComposed,
)
from veil.errors import UnsupportedEventError

__all__ = ["HistoryEntry", "dpsgd_history"]


class HistoryEntry(NamedTuple):
    """One run of identical DP-SGD steps (unpacks like Opacus's history tuples)."""

    noise_multiplier: float
    sample_rate: float
    num_steps: int


def _steps(event: PrivacyEvent, count: int) -> Iterator[tuple[float, float, int]]:
    if isinstance(event, NoOp):
        return
    if isinstance(event, SelfComposed):
        yield from _steps(event.event, count * event.count)
    elif isinstance(event, Composed):
        for _ in range(count):
            for e in event.events:
                yield from _steps(e, 1)
    elif isinstance(event, NonPrivate):
        yield 0.0, 1.0, count
    elif isinstance(event, Gaussian):
        yield event.noise_multiplier, 1.0, count
    elif isinstance(event, PoissonSampled) and isinstance(event.event, Gaussian):
        yield event.event.noise_multiplier, event.sampling_rate, count
    else:
        raise UnsupportedEventError(
            "event",
            event.to_json(),
            "the history view lists DP-SGD steps (σ, q, count) and this event is not one",
            "read accountant.ledger for the full record",
        )


def dpsgd_history(events: Iterable[PrivacyEvent]) -> list[HistoryEntry]:
    """The DP-SGD steps of ``events`` as merged ``(noise_multiplier, sample_rate, num_steps)`` runs."""
    out: list[HistoryEntry] = []
    for event in events:
        for sigma, q, k in _steps(event, 1):
            if out and out[-1][:2] == (sigma, q):
                out[-1] = HistoryEntry(sigma, q, out[-1].num_steps + k)
            else:
                out.append(HistoryEntry(sigma, q, k))
    return out
