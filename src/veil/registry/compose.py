"""Composing the privacy events of several runs on one dataset with veil's accountants.

Guarantee. If each run ``i`` on a dataset released only what its events describe (each event's
mechanism run on the dataset, adaptively chosen), then the ε at δ reported here for the concatenation
of all runs' events bounds the privacy loss of everything those runs released together, under the
dataset's neighbouring relation (adaptive composition). This is never the sum of the runs' ε: the
accountants compose privacy-loss distributions (PLD) or Rényi divergences (RDP).

Which accountant. A dataset's ``accountant`` is

* ``"auto"`` (the default): every accountant that can bound *all* the charged events is run and the
  smallest ε is reported. Each is a valid upper bound on the same composed mechanism's ε at δ, so
  their minimum is too. In practice: DP-SGD, Laplace and Gaussian releases get PLD (usually the
  tighter) or RDP, whichever is smaller; as soon as one event is RDP-only — an exponential-mechanism
  selection (``veil synth``), a zCDP reservation, a tuning run's
  :class:`~veil.accounting.events.RepeatAndSelect` — the whole dataset is composed in RDP, since
  guarantees from different accountants do not compose with each other. If no accountant bounds
  every event, the event is refused, named.
* ``"pld"`` or ``"rdp"``: that accountant only (a data owner's explicit choice; an event it cannot
  bound is refused).

The RDP side is :func:`veil.accounting.tuning.events_rdp` (the RDP accountant plus the events only an
RDP analysis bounds), converted at δ with the same conversion as every RDP run.

``(0, δ)`` parts. :class:`~veil.accounting.events.DeltaOnly` events (the thresholds of a DP schema
release) are not composed by an accountant: with ``Σ δ_i`` their total, ε is the accountants' ε at
``δ − Σ δ_i`` (see the event's docstring for why δ's add); when every event is pure ε-DP the sum of
their ε (basic composition) is a bound too, the only one left if ``Σ δ_i = δ``; ∞ if ``Σ δ_i > δ``. An
:class:`~veil.accounting.events.ApproximateDP` ``(ε_i, δ_i)`` (``veil pate``'s guarantee) gives its
``δ_i`` to that sum and its ε-DP part to RDP, as randomized response RR(ε_i).

Order-free: both accountants are, so :func:`compact` may merge identical events into one
:class:`~veil.accounting.events.SelfComposed` without changing the bound. Events are stored as the
ledger writes them (``PrivacyEvent.to_dict``) and read back through
:func:`~veil.accounting.events.event_from_dict`, which validates them again: an unknown event kind is
refused, never skipped.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from veil.accounting.base import make_accountant
from veil.accounting.events import (
    ApproximateDP,
    Composed,
    DeltaOnly,
    ExponentialMechanism,
    Laplace,
    Neighbouring,
    PrivacyEvent,
    SelfComposed,
    event_from_dict,
)
from veil.accounting.interface import check_delta
from veil.errors import InvalidParameterError, UnsupportedEventError

__all__ = [
    "DEFAULT_ACCOUNTANT",
    "REGISTRY_ACCOUNTANTS",
    "RegistryAccountant",
    "accountants_for",
    "check_accountant",
    "check_events",
    "compact",
    "events_from_json",
    "events_to_json",
    "spent_epsilon",
]

RegistryAccountant = Literal["auto", "pld", "rdp"]
REGISTRY_ACCOUNTANTS: tuple[RegistryAccountant, ...] = ("auto", "pld", "rdp")
DEFAULT_ACCOUNTANT: RegistryAccountant = "auto"
"""A new dataset's accountant: the tighter of PLD and RDP among those that bound every event."""


def compact(events: Iterable[PrivacyEvent]) -> list[PrivacyEvent]:
    """Identical events merged into ``SelfComposed(event, count)``, in order of first appearance.

    A run's ledger holds one event per DP-SGD step; the registry keeps one record per distinct event.
    Nested ``SelfComposed`` records of the same event are merged too, so counts add up. ``DeltaOnly``
    and ``ApproximateDP`` events are kept one by one (their δ's add; they are not composed by an
    accountant).
    """
    counts: Counter[PrivacyEvent] = Counter()
    for event in events:
        if isinstance(event, SelfComposed):
            if event.count:
                counts[event.event] += event.count
        else:
            counts[event] += 1
    out: list[PrivacyEvent] = []
    for e, n in counts.items():
        if isinstance(e, (DeltaOnly, ApproximateDP)):
            out.extend([e] * n)
        else:
            out.append(e if n == 1 else SelfComposed(e, n))
    return out


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


def _split(events: Iterable[PrivacyEvent]) -> tuple[list[PrivacyEvent], float]:
    """(the events an accountant composes, the total δ of the ``DeltaOnly`` parts)."""
    rest: list[PrivacyEvent] = []
    extra = 0.0
    for e in events:
        if isinstance(e, DeltaOnly):
            extra += e.delta
        elif isinstance(e, ApproximateDP):  # δ apart, the rest an ε-DP release (see the event)
            extra += e.delta
            if e.epsilon > 0:
                rest.append(ApproximateDP(e.epsilon))
        else:
            rest.append(e)
    return rest, extra


def _supports(name: str, events: Sequence[PrivacyEvent], relation: Neighbouring) -> bool:
    if name == "pld":
        acc = make_accountant("pld", relation)
        return all(acc.supports(e) for e in events)
    try:
        from veil.accounting.rdp import DEFAULT_ORDERS
        from veil.accounting.tuning import events_rdp

        events_rdp(events, DEFAULT_ORDERS[:1], relation)
    except UnsupportedEventError:
        return False
    return True


def check_accountant(accountant: str) -> None:
    """Refuse a registry accountant name that is not one of :data:`REGISTRY_ACCOUNTANTS`."""
    if accountant not in REGISTRY_ACCOUNTANTS:
        raise InvalidParameterError(
            "accountant",
            accountant,
            "only known accountants give a checked bound",
            f"use one of {list(REGISTRY_ACCOUNTANTS)}",
        )


def accountants_for(
    events: Sequence[PrivacyEvent],
    accountant: RegistryAccountant | str = "auto",
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> list[str]:
    """The accountants that bound every event (for ``"auto"``: PLD and/or RDP), or an error naming one.

    Raises :class:`~veil.errors.UnsupportedEventError` (from the accountant asked, or for ``"auto"``
    from RDP, the one that bounds the most kinds) when none can bound all of them.
    """
    check_accountant(accountant)
    relation = Neighbouring(neighbouring)
    rest, _ = _split(events)
    names = ["pld", "rdp"] if accountant == "auto" else [str(accountant)]
    usable = [n for n in names if _supports(n, rest, relation)]
    if not usable:
        _raise_unsupported(names[-1], rest, relation)
    return usable


def _raise_unsupported(name: str, events: Sequence[PrivacyEvent], relation: Neighbouring) -> None:
    if name == "pld":
        acc = make_accountant("pld", relation)
        for e in events:
            acc.compose(e)  # raises, naming the event
    from veil.accounting.tuning import events_rdp

    events_rdp(events, (2.0,), relation)  # raises, naming the event
    raise AssertionError("unreachable: an event was reported unsupported")  # pragma: no cover


def check_events(
    events: Sequence[PrivacyEvent],
    accountant: RegistryAccountant | str,
    neighbouring: Neighbouring,
    others: Sequence[PrivacyEvent] = (),
) -> list[PrivacyEvent]:
    """The events compacted, after checking that each reads back and that the dataset's accountant
    can bound them together with ``others`` (the dataset's charged events); raises otherwise."""
    merged = compact(events)
    for e in merged:
        event_from_dict(e.to_dict())  # a stored event must read back
    accountants_for([*compact(others), *merged], accountant, neighbouring)
    return merged


def _epsilon(name: str, events: Sequence[PrivacyEvent], delta: float, relation: Neighbouring) -> float:
    if name == "pld":
        acc = make_accountant("pld", relation)
        for e in events:
            acc.compose(e)
        eps = acc.epsilon(delta)
    else:
        from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
        from veil.accounting.tuning import events_rdp

        curve = events_rdp(events, DEFAULT_ORDERS, relation)
        eps = 0.0 if not curve.any() else rdp_to_epsilon(DEFAULT_ORDERS, curve, delta)
    return math.inf if math.isnan(eps) else float(eps)


def spent_epsilon(
    runs: Iterable[Sequence[PrivacyEvent]],
    delta: float,
    accountant: RegistryAccountant | str = "auto",
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> float:
    """The composed ε at ``delta`` of all runs' events (0 when there is none, ∞ if one is non-private
    or the ``DeltaOnly`` parts use up ``delta``); see the module docstring for the accountant rule."""
    delta = check_delta(delta)
    rest, extra = _split(compact(e for run in runs for e in run))
    if not rest and extra == 0.0:
        return 0.0
    if extra > delta * (1 + _ROUNDING):
        return math.inf
    relation = Neighbouring(neighbouring)
    names = accountants_for(rest, accountant, relation)
    pure = _pure_epsilon(rest)
    if extra >= delta * (1 - _ROUNDING):  # no δ left for the accountants: only a pure-DP bound holds
        return math.inf if pure is None else pure
    if not rest:
        return 0.0
    eps = min(_epsilon(n, rest, delta - extra, relation) for n in names)
    return eps if pure is None else min(eps, pure)


def overruns(
    planned: Sequence[PrivacyEvent],
    actual: Sequence[PrivacyEvent],
    delta: float,
    accountant: RegistryAccountant | str = "auto",
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE,
) -> list[tuple[str, float, float]]:
    """``(accountant, planned ε, actual ε)`` for each accountant of the dataset (``"auto"``: PLD and
    RDP) that bounds both event lists and in which ``actual`` costs more than ``planned`` at ``delta``
    (beyond float rounding): the run released more than it reserved. Empty when it did not."""
    relation = Neighbouring(neighbouring)
    names = ["pld", "rdp"] if accountant == "auto" else [str(accountant)]
    plan_rest, _ = _split(compact(planned))
    actual_rest, _ = _split(compact(actual))
    found = []
    for name in names:
        if not (_supports(name, plan_rest, relation) and _supports(name, actual_rest, relation)):
            continue
        before = spent_epsilon([planned], delta, name, relation)
        after = spent_epsilon([actual], delta, name, relation)
        if after > before * (1 + _OVERRUN_SLACK) + _OVERRUN_SLACK:
            found.append((name, before, after))
    return found


_OVERRUN_SLACK = 1e-9
"""Relative (and absolute) float slack when comparing a run's released ε with its planned ε."""

_ROUNDING = 1e-12
"""Relative float rounding allowed when the ``DeltaOnly`` parts add up to δ itself (k shares δ/k)."""


def _pure_epsilon(events: Sequence[PrivacyEvent]) -> float | None:
    """Σ ε of the events when each is pure ε-DP (basic composition), else None.

    A bound that holds at every δ ≥ the ``DeltaOnly`` parts, so the smaller of it and the accountants'
    is still a bound; it is the only one left when those parts use up δ (a lone ``veil pate`` or DP
    schema release reported at its own δ).
    """
    total = 0.0
    for e in events:
        if isinstance(e, SelfComposed):
            inner = _pure_epsilon([e.event])
            if inner is None:
                return None
            total += e.count * inner
        elif isinstance(e, Composed):
            inner = _pure_epsilon(e.events)
            if inner is None:
                return None
            total += inner
        elif isinstance(e, Laplace):
            total += e.pure_epsilon
        elif isinstance(e, (ApproximateDP, ExponentialMechanism)) and not getattr(e, "delta", 0.0):
            total += e.epsilon
        else:
            return None
    return total
