"""Composing the privacy events of several runs on one dataset with veil's accountant.

Guarantee. If each run ``i`` on a dataset released only what its events describe (each event's
mechanism run on the dataset, adaptively chosen), then the accountant's ε at δ for the concatenation
of all runs' events bounds the privacy loss of everything those runs released together, under the
dataset's neighbouring relation (adaptive composition). This is never the sum of the runs' ε: the
accountants compose privacy-loss distributions (PLD) or Rényi divergences (RDP), which is tighter and
exact in the same sense as for one run. Both accountants are order-free, so :func:`compact` may merge
identical events into one :class:`~veil.accounting.events.SelfComposed` without changing the bound.

Events are stored as the ledger writes them (``PrivacyEvent.to_dict``) and read back through
:func:`~veil.accounting.events.event_from_dict`, which validates them again: an unknown event kind is
refused, never skipped.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from veil.accounting.base import AccountantName, PrivacyAccountant, make_accountant
from veil.accounting.events import Neighbouring, PrivacyEvent, SelfComposed, event_from_dict
from veil.errors import InvalidParameterError

__all__ = ["compact", "compose", "events_from_json", "events_to_json", "spent_epsilon"]


def compact(events: Iterable[PrivacyEvent]) -> list[PrivacyEvent]:
    """Identical events merged into ``SelfComposed(event, count)``, in order of first appearance.

    A run's ledger holds one event per DP-SGD step; the registry keeps one record per distinct event.
    Nested ``SelfComposed`` records of the same event are merged too, so counts add up.
    """
    counts: Counter[PrivacyEvent] = Counter()
    for event in events:
        if isinstance(event, SelfComposed):
            if event.count:
                counts[event.event] += event.count
        else:
            counts[event] += 1
    return [e if n == 1 else SelfComposed(e, n) for e, n in counts.items()]


def events_to_json(events: Sequence[PrivacyEvent]) -> str:
    """The stored form: a JSON list of ``to_dict()`` records (the ledger's serialisation)."""
    return json.dumps([e.to_dict() for e in events], sort_keys=True, separators=(",", ":"), allow_nan=False)


def events_from_json(text: str) -> list[PrivacyEvent]:
    """Inverse of :func:`events_to_json`; every event is validated again."""
    data: Any = json.loads(text)
    if not isinstance(data, list):
        raise InvalidParameterError(
            "events", text[:80], "a stored run must hold a list of events", "repair the registry row"
        )
    return [event_from_dict(d) for d in data]


def compose(
    runs: Iterable[Sequence[PrivacyEvent]],
    accountant: AccountantName = "pld",
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> PrivacyAccountant:
    """One accountant holding every event of every run (refuses an unsupported event, naming it)."""
    acc = make_accountant(accountant, neighbouring)
    for event in compact(e for run in runs for e in run):
        acc.compose(event)
    return acc


def spent_epsilon(
    runs: Iterable[Sequence[PrivacyEvent]],
    delta: float,
    accountant: AccountantName = "pld",
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> float:
    """The composed ε at ``delta`` of all runs' events (0 when there is none, ∞ if one is non-private)."""
    runs = [list(r) for r in runs]
    if not any(runs):
        return 0.0
    eps = compose(runs, accountant, neighbouring).epsilon(delta)
    return math.inf if math.isnan(eps) else float(eps)
