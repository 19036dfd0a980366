"""A federated run's account with the privacy-budget registry: what it charges its dataset, and when.

The registry's relation is add/remove one *record* of the dataset named by ``--dataset`` (the
union of every simulated client's rows), under the same identity ``veil train`` gives that spec. The
simulated partition is record-local (:mod:`veil.federated.partition`): adding or removing one row
changes exactly one client's data, by that row. The charge in each mode:

**Record-level silos.** A record x lives in one silo k. Silo k's DP-SGD steps are the only mechanism
that reads x; every other silo's releases depend on x only through global models that are already
outputs of silo k's steps (adaptive composition). So, with every other run on the dataset, x's privacy
loss is that of the other runs' events composed with silo k's step events (parallel composition, as
the run's own report states its guarantee: the largest silo). The registry must bound every record,
so the charge must bound *every* silo's events in composition with any other events, not merely the
silo whose ε is largest alone (curves can cross once composed). The charge is:

* the silos' events themselves when every silo's events are identical (equal q = B/n_k and σ_k, e.g.
  silos of one size): exactly the run's guarantee;
* otherwise the cheaper (by ε alone at the run's δ) of two bounds, chosen from public values only
  (the silos' q, σ and the planned steps): ``T × PoissonSampled(max_k q_k, Gaussian(min_k σ_k))``,
  which dominates each silo's ``T_k ≤ T`` steps (a lower rate is a post-processing of a higher one:
  keep the sampled output with probability q_k/q, else draw from the null distribution; a larger σ
  is a post-processing of a smaller one: add noise), composable by PLD and RDP; or
  ``OneOf(silo events)``, whose RDP curve is the pointwise largest of the silos' curves, so that
  ``prior + max_k RDP_k ≥ prior + RDP_k`` for the record's own silo k (RDP only: the dataset is then
  composed in RDP).

Silo sizes n_k (hence q_k, σ_k) are treated as public, as DP-SGD's q = B/N is in ``veil train``.
With a privacy unit (:mod:`veil.federated.units`) read "record" as "person with all their rows": a
person lies in one silo and n_k counts the silo's units; the registry's relation is then add/remove
one unit, and the same argument gives the same charge.

**Client-level DP-FedAvg.** Its guarantee is per client (add/remove one whole client). A record
added to the dataset lands in one client c, which stays in the federation: c's clipped update moves
from u to u', both in the C-ball, so ``‖u − u'‖ ≤ 2C`` — a *replacement* inside the Poisson-sampled
sum, not an addition. One round releases, under the two datasets, ``P = (1−q)·R + q·A`` and
``P' = (1−q)·R + q·B`` with the same coin for c (R: c not sampled; A = N(a + u, σ²C²I), B = N(a + u',
σ²C²I), a the others' sum, identical on both sides). The hockey-stick divergence is jointly convex,
so for every α ≥ 0: ``H_α(P‖P') ≤ (1−q)·H_α(R‖R) + q·H_α(A‖B) ≤ H_α(A‖B)`` (``H_α(R‖R) = max(0,
1−α) ≤ H_α(A‖B)``), and (A, B) is a Gaussian pair at distance ≤ 2C, dominated by ``Gaussian(σ/2)``
(the pair at distance exactly 2C, a post-processing of which gives any shorter one). A dominating
pair per round composes (Zhu, Dong & Wang, AISTATS 2022), so each charged round is charged as
``Gaussian(σ/2)``: sensitivity 2C **without** amplification by client sampling. The amplified
``PoissonSampled(q, Gaussian(σ/2))`` is not used: one-sided (add or remove) dominating pairs do not
in general bound a mixture-vs-mixture (substitution) pair under composition (Lebeda, Regehr, Kamath
& Steinke, 2024), and veil has no proof for this one; the charge is sound and loose (about twice the
client-level ε at q = 1, more at q < 1).

**When.** :meth:`FederatedCharge.before_reading` — before a row is read (an exhausted dataset refuses
the run); :meth:`FederatedCharge.reserve` — client level before a row is read (the plan needs only
σ, q and the rounds), record level after the job planned the run (the silos' sizes need the data);
both before the run folder exists or any client or silo starts; :meth:`FederatedCharge.settle` —
at the end, with what the run folder's ledger says was charged when the run finished (a run that
stopped before its end keeps its whole plan charged). A resumed run re-admits its whole remaining plan
(:meth:`FederatedCharge.resume`), from the one copy of its folder that holds it
(:mod:`veil.registry.resume_lease`).

A real Flower deployment whose SuperNodes hold their own data (``flwr run`` against remote
SuperNodes) is not charged here: the data is not on this machine and has no identity the server could
compute; each data holder would keep its own account (see ``docs/budget.md``).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from veil.accounting.events import (
    Composed,
    Gaussian,
    OneOf,
    PoissonSampled,
    PrivacyEvent,
    SelfComposed,
)
from veil.federated.settings import FederatedSettings

__all__ = [
    "FederatedCharge",
    "client_level_charge",
    "planned_events",
    "settled_events",
    "silo_charge",
    "silo_plan",
]

Form = Literal["dominating", "one_of"]


@functools.lru_cache(maxsize=256)
def silo_plan(s: FederatedSettings, n: int) -> tuple[float, float]:
    """``(q, σ)`` of a silo of ``n`` records (rows, or units with a privacy unit): q = min(1, B/n)
    and σ calibrated for the target ε over the planned
    ``rounds × local_steps`` DP-SGD steps (what every silo computes for itself, :mod:`.apps`)."""
    from veil.accounting.calibrate import calibrate_noise
    from veil.federated.local import silo_sampling_rate

    q = silo_sampling_rate(s, n)
    sigma = calibrate_noise(s.epsilon, s.delta, q, s.rounds * s.local_steps, accountant=s.accountant)
    return q, float(sigma)


def client_level_charge(sigma: float, rounds: int) -> list[PrivacyEvent]:
    """The registry's charge of ``rounds`` client-level rounds: ``Gaussian(σ/2)`` each (module doc)."""
    return [SelfComposed(Gaussian(sigma / 2.0), rounds)] if rounds > 0 else []


def _round_units(event: PrivacyEvent) -> int:
    """How many client-level rounds a ledger event stands for (a round event, or one composed)."""
    if isinstance(event, SelfComposed):
        return event.count * _round_units(event.event)
    if isinstance(event, (Gaussian, PoissonSampled)):
        return 1
    raise ValueError(f"not a client-level round event: {event.to_dict()}")


def _steps(event: PrivacyEvent) -> list[tuple[float, float, int]]:
    """``(q, σ, count)`` of the DP-SGD step events inside ``event``."""
    if isinstance(event, SelfComposed):
        return [(q, s, c * event.count) for q, s, c in _steps(event.event)]
    if isinstance(event, Composed):
        return [t for e in event.events for t in _steps(e)]
    if isinstance(event, PoissonSampled) and isinstance(event.event, Gaussian):
        return [(event.sampling_rate, event.event.noise_multiplier, 1)]
    if isinstance(event, Gaussian):
        return [(1.0, event.noise_multiplier, 1)]
    raise ValueError(f"not a DP-SGD step event: {event.to_dict()}")


def _dominating(silo_events: Sequence[Sequence[PrivacyEvent]]) -> list[PrivacyEvent]:
    from veil.accounting.calibrate import dpsgd_event

    steps = [[t for e in events for t in _steps(e)] for events in silo_events]
    flat = [t for silo in steps for t in silo]
    if not flat:
        return []
    q = max(t[0] for t in flat)
    sigma = min(t[1] for t in flat)
    count = max(sum(t[2] for t in silo) for silo in steps)
    return [SelfComposed(dpsgd_event(q, sigma), count)]


def _one_of(silo_events: Sequence[Sequence[PrivacyEvent]]) -> list[PrivacyEvent]:
    distinct: list[PrivacyEvent] = []
    for events in silo_events:
        e = Composed(events)
        if e not in distinct:
            distinct.append(e)
    return [OneOf(distinct)]


def silo_charge(silo_events: Sequence[Sequence[PrivacyEvent]], form: Form) -> list[PrivacyEvent]:
    """The registry's charge of record-level silos with these events (module doc): the events
    themselves when every silo's are the same, else the bound ``form`` names."""
    from veil.registry.compose import compact

    lists = [compact(events) for events in silo_events]
    lists = [events for events in lists if events]
    if not lists:
        return []
    if all(events == lists[0] for events in lists):
        return lists[0]
    return _dominating(lists) if form == "dominating" else _one_of(lists)


def choose_form(plans: Sequence[tuple[float, float]], steps: int, delta: float) -> Form:
    """Of the two bounds on different silos, the one with the smaller ε alone at ``delta`` — a choice
    made from public values only (the silos' q and σ and the planned steps), the same at plan and
    settle time."""
    from veil.accounting.calibrate import dpsgd_event
    from veil.registry.compose import spent_epsilon

    silo_events = [[SelfComposed(dpsgd_event(q, s), steps)] for q, s in sorted(set(plans))]
    if len(silo_events) <= 1:
        return "dominating"
    dominating = spent_epsilon([_dominating(silo_events)], delta, "auto")
    one_of = spent_epsilon([_one_of(silo_events)], delta, "rdp")
    return "dominating" if dominating <= one_of else "one_of"


def planned_events(
    s: FederatedSettings, silo_sizes: Sequence[int] = (), done: Sequence[PrivacyEvent] = ()
) -> list[PrivacyEvent]:
    """The whole run's charge as planned: every planned round (record level: every silo's planned
    steps, silos of ``silo_sizes`` rows)."""
    from veil.accounting.calibrate import dpsgd_event

    if s.mode == "client-level":
        return client_level_charge(s.sigma, s.rounds)
    plans = [silo_plan(s, n) for n in silo_sizes]
    steps = s.rounds * s.local_steps
    form = choose_form(plans, steps, s.delta)
    return silo_charge([[SelfComposed(dpsgd_event(q, sigma), steps)] for q, sigma in plans], form)


def settled_events(s: FederatedSettings, run_dir: Path, extra_rounds: int = 0) -> list[PrivacyEvent]:
    """What the run folder's ledger charged, as the registry's events (plus ``extra_rounds`` more
    rounds, for a resume's plan). No ledger: nothing was released, nothing is charged (client level:
    the ``extra_rounds`` alone)."""
    from veil.accounting.calibrate import dpsgd_event
    from veil.accounting.ledger import Ledger
    from veil.federated.files import LEDGER, SILOS

    if not (run_dir / LEDGER).exists():
        return client_level_charge(s.sigma, extra_rounds) if s.mode == "client-level" else []
    ledger = Ledger.open(run_dir / LEDGER)
    if s.mode == "client-level":
        rounds = sum(_round_units(e) for e in ledger.events())
        return client_level_charge(s.sigma, rounds + extra_rounds)
    if not (run_dir / SILOS).exists():
        return []
    from veil.federated.report import silo_events

    silos = json.loads((run_dir / SILOS).read_text())
    per_silo = silo_events(ledger, silos)
    plans = [(float(v["sampling_rate"]), float(v["noise_multiplier"])) for v in silos.values()]
    lists = []
    for name, info in silos.items():
        extra = SelfComposed(
            dpsgd_event(float(info["sampling_rate"]), float(info["noise_multiplier"])),
            extra_rounds * s.local_steps,
        )
        lists.append([*per_silo[name], extra] if extra_rounds else per_silo[name])
    return silo_charge(lists, choose_form(plans, s.rounds * s.local_steps, s.delta))


class FederatedCharge:
    """``veil federated``'s :class:`~veil.registry.charge.DatasetCharge` (see the module doc)."""

    def __init__(self, s: FederatedSettings, *, resume: bool = False) -> None:
        from veil.pipeline.private_data import data_ref, open_account

        self.charge = open_account(data_ref(s.dataset, s), job="federated", refuse_if_spent=not resume).charge

    @classmethod
    def before_reading(cls, s: FederatedSettings, *, resume: bool = False) -> FederatedCharge:
        """Identify the dataset; refuse at once if its recorded runs already spend its budget."""
        return cls(s, resume=resume)

    def with_ids(self, s: FederatedSettings) -> FederatedSettings:
        """``s`` with a new registry run id and the dataset's id, fixed *before* the registry is asked
        (:meth:`reserve`, :meth:`reserve_stand_in`): an interrupt that lands after the registry's
        commit and before the call returns still leaves the caller holding the id of the run the
        registry recorded (:meth:`holds` says whether it did), so the run folder it then writes
        names that run, for ``--resume``."""
        return s.replace(budget_run_id=uuid.uuid4().hex, budget_dataset_id=self.charge.identity.id)

    def holds(self, s: FederatedSettings) -> bool:
        """Whether the registry recorded the run ``s`` names (read-only; False without an id)."""
        return s.budget_run_id is not None and self.charge.registry.run(s.budget_run_id) is not None

    def reserve(self, s: FederatedSettings, silo_sizes: Sequence[int]) -> FederatedSettings:
        """Admit the whole planned run (``s`` from :meth:`with_ids`) or raise
        :class:`~veil.errors.BudgetExhaustedError` (nothing recorded); the settings returned carry the
        registry's run and dataset ids to the ledger."""
        assert s.budget_run_id is not None, "with_ids before reserving"
        self.charge.reserve(planned_events(s, silo_sizes), s.budget_run_id, s.delta)
        return s.replace(budget_dataset_id=self.charge.identity.id)

    def reserve_stand_in(self, s: FederatedSettings) -> FederatedSettings:
        """Record level, before a row is read: admit the stand-in (the target ε at δ,
        :func:`~veil.pipeline.private_data.stand_in_plan`; ``s`` from :meth:`with_ids`) or refuse with
        nothing recorded; from here the run stays charged (the data is read next)."""
        from veil.pipeline.private_data import stand_in_plan

        assert s.budget_run_id is not None, "with_ids before reserving"
        self.charge.reserve(stand_in_plan(s.epsilon, s.delta), s.budget_run_id, s.delta, before_reading=True)
        self.charge.reading()
        return s.replace(budget_dataset_id=self.charge.identity.id)

    def replan(self, s: FederatedSettings, silo_sizes: Sequence[int]) -> None:
        """Replace the stand-in by the whole planned run (silos of ``silo_sizes`` records); over the
        budget: :class:`~veil.errors.BudgetExhaustedError`, the stand-in stays charged."""
        self.charge.replan(planned_events(s, silo_sizes), s.delta)

    def resume(self, s: FederatedSettings, run_dir: Path, remaining: int) -> None:
        """Re-admit a stopped run: what its ledger charged plus its ``remaining`` rounds."""
        from veil.federated.files import LEDGER, SILOS

        run_id = s.budget_run_id or uuid.uuid4().hex
        records = _ledger_records(run_dir)
        # A copy of the folder that cannot continue the run is refused before a row is read.
        self.charge.check_resume(run_id, run_dir, records)
        if s.mode == "record-level" and not ((run_dir / SILOS).exists() and (run_dir / LEDGER).exists()):
            events = planned_events(s, _silo_sizes(s))  # no round charged: the whole plan
        else:
            events = settled_events(s, run_dir, extra_rounds=remaining)
        # Refused if another copy of this folder resumed the run since, or if its ledger is older than
        # the one the run was settled with (veil.registry.resume_lease).
        self.charge.resume(run_id, events, s.delta, folder=run_dir, ledger_records=records)

    def release(self) -> None:
        """Un-charge the reservation: only when nothing computed from the data was released."""
        self.charge.release()

    def settle(self, s: FederatedSettings, run_dir: Path) -> None:
        """A finished run (its ledger's ``end`` record): charge what the ledger holds in place of the
        plan. No ledger, or a run that stopped before its end (an interrupt, a failed round): the plan
        stays charged once a row was read (revD's F7: the stop may depend on the data, so the refund
        would too); ``--resume`` continues it at no further charge."""
        from veil.accounting.ledger import Ledger
        from veil.federated.files import LEDGER

        if not (run_dir / LEDGER).exists():
            self.charge.release()
            return
        ledger = Ledger.open(run_dir / LEDGER)
        if ledger.last("end") is None:
            self.charge.release(len(ledger.records))
        else:
            self.charge.settle(settled_events(s, run_dir), len(ledger.records))

    def close(self) -> None:
        self.charge.close()


def _ledger_records(run_dir: Path) -> int:
    """The run folder's ledger length (0 before the first round wrote it)."""
    from veil.accounting.ledger import Ledger
    from veil.federated.files import LEDGER

    path = run_dir / LEDGER
    return len(Ledger.open(path).records) if path.exists() else 0


def _silo_sizes(s: FederatedSettings) -> list[int]:
    from veil.federated.local import federation

    fed = federation(s)
    return [fed.records(k) for k in range(len(fed.parts))]
