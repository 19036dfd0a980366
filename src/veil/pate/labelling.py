"""Answering the student's queries within a privacy budget, with both ε computed and stated.

:func:`label_queries` asks queries in their (public) order, answers each with the aggregator, and
stops when the budget is spent. What it returns is the whole privacy-relevant output: the labels
(or "not answered") and, for GNMax/Confident-GNMax, the privately released data-dependent cost.
The settings, the plan and the result are :mod:`veil.pate.label_settings`; the Propose-Test-Release
budget is :mod:`veil.pate.ptr_labelling`.

Two budgets (``budget``):

* ``"data-independent"`` (default). The guarantee is worst-case over all datasets.
  LNMax/GNMax: every answer costs the same, so the number of answers that fit the target is fixed
  in advance from public parameters. Confident-GNMax: every query asked costs a threshold check
  (``ρ₁ = 1/(2z₁²)`` per order-α unit, i.e. RDP ``αρ₁``) and every answer a GNMax step (``αρ₂``);
  which queries are answered depends on released (private) outcomes, so the stopping rule is a
  Rényi *filter* (Feldman & Zrnic 2021): a query is asked only if ``ρ_spent + ρ₁ + ρ₂ ≤ ρ_max``,
  ``ρ_max`` fixed in advance. All costs are linear in α, so the filter holds at every order at
  once and the run is ``(α, α·min(ρ_max, Q·(ρ₁+ρ₂)) + releases)``-RDP for every α. The final
  data-dependent release (GNSS) is paid from the same budget.
* ``"data-dependent"`` (GNMax/Confident-GNMax). Queries are asked in chunks of at most
  ``check_every``; after each chunk the data-dependent cost is released (each release paid for).
  The first chunk is as long as its worst-case cost allows within the target; each later one as
  long as a prediction from the released values only (twice the released average cost per query,
  at most the worst case) allows; the run stops when no query fits. The release is noisy, so the
  final released ε can still exceed the target. A chunk shorter than ``check_every`` (other than
  the first) is the last, so at most ``⌈queries/check_every⌉ + 2`` releases happen. The
  data-independent ε is then the worst case over ``queries`` asked and answered plus that many
  releases, usually far above the target: the target is met only in the data-dependent sense
  (see ``docs/pate.md``).

``epsilon_data_dependent`` is ``ε(δ)`` at the release order λ of ``r̃ + releases·ε_ss(λ)``, where
``r̃ ≥ r(D)`` with probability ``confidence`` (:mod:`veil.pate.smooth_sensitivity`), capped by the
data-independent ε (which bounds the per-instance loss too). It states,
with that probability, per-instance privacy for *this* dataset: for every neighbour D' of D,
``Pr[M(D) ∈ E] ≤ e^ε·Pr[M(D') ∈ E] + δ``. Only ``epsilon_data_independent`` holds for every
dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from veil.accounting.events import Gaussian
from veil.accounting.rdp import rdp_to_epsilon
from veil.errors import InvalidParameterError
from veil.mechanisms.rng import RandomSource
from veil.pate.label_settings import BudgetPlan, LabelResult, LabelSettings
from veil.pate.ptr_labelling import label_ptr, ptr_plan
from veil.pate.smooth_sensitivity import DataDependentAccount
from veil.pate.spending import ORDERS, EventTally, largest, rdp_epsilon, rdp_of, rho_of, too_small

__all__ = ["label_queries", "plan_budget", "planned_epsilon"]


def _chunk(
    level: float, per_query: float, releases: int, rel_lam: float, order: float, s: LabelSettings, most: int
) -> int:
    """Largest n ≤ most with ε_λ(level + n·per_query + releases·ε_ss(λ)) ≤ target."""
    return largest(
        lambda n: rdp_to_epsilon([order], [level + n * per_query + releases * rel_lam], s.delta) <= s.epsilon,
        most,
    )


def _release_curves(s: LabelSettings) -> tuple[np.ndarray, float]:
    """The RDP curve of one data-dependent release, and its value at the release order."""
    release = s.release if s.uses_release else None
    if release is None:
        return np.zeros_like(ORDERS), 0.0
    return release.rdp(ORDERS), float(release.rdp(release.order)[0])


def plan_budget(settings: LabelSettings, secure: bool, available_queries: int | None = None) -> BudgetPlan:
    """The budget plan of ``settings``; raises :class:`~veil.errors.UnreachableTargetError` if not even
    one query fits. Depends on public parameters only, so it can run before any teacher is trained."""
    s = settings
    q_max = s.max_queries if available_queries is None else min(s.max_queries, available_queries)
    agg = s.aggregator
    events = agg.query_events(secure)
    ans_event = agg.answer_event(secure)
    thr_event = events[0] if len(events) > 1 else None
    assert thr_event is None or isinstance(thr_event, Gaussian)
    rel_curve, rel_lam = _release_curves(s)
    rho2 = rho_of(ans_event) if isinstance(ans_event, Gaussian) else math.nan
    rho1 = rho_of(thr_event) if thr_event is not None else 0.0
    n_answers, rho_max, rule = q_max, math.inf, None
    if s.budget == "data-independent":
        rule = agg.data_independent_budget(s.epsilon, s.delta, s.accountant, rel_curve, q_max, secure)
        n_answers, rho_max = rule.max_answers, rule.rho_max
    elif s.budget == "ptr":
        ptr_plan(s, secure, q_max)
    else:
        assert s.release is not None
        per_query = s.release.order * (rho1 + rho2)  # worst case of one query at λ (Gaussian events)
        n_answers = _chunk(0.0, per_query, 1, rel_lam, s.release.order, s, min(s.check_every, q_max))
        if n_answers == 0:
            raise too_small(
                s.epsilon,
                "the first chunk of queries must fit the target by its worst-case cost, and one does not",
            )
    return BudgetPlan(
        max_queries=q_max,
        max_answers=n_answers,
        rho_max=rho_max,
        rho_threshold=rho1,
        rho_answer=rho2,
        answer_event=ans_event,
        threshold_event=thr_event,
        answer_rdp=rdp_of(ans_event),
        release_rdp=rel_curve,
        release_rdp_at_order=rel_lam,
        query_events=events,
        rule=rule,
    )


def _check_histograms(histograms: np.ndarray, s: LabelSettings) -> np.ndarray:
    hist = np.asarray(histograms)
    if hist.ndim != 2 or hist.shape[1] != s.num_classes or not np.issubdtype(hist.dtype, np.integer):
        raise InvalidParameterError(
            "histograms",
            hist.shape,
            "one integer vote count per class per query",
            "pass (queries, classes) ints",
        )
    if hist.shape[0] and (np.any(hist < 0) or np.any(hist.sum(axis=1) > s.num_teachers)):
        raise InvalidParameterError(
            "histograms",
            "counts",
            "each of the K teachers votes at most once per query (a teacher without data abstains); "
            "the analysis assumes non-negative counts summing to at most K",
            "pass the teachers' vote counts",
        )
    return hist


@dataclass
class _Labelling:
    """The state of one labelling run: what was asked and answered, the events spent, the releases."""

    s: LabelSettings
    plan: BudgetPlan
    rng: RandomSource
    labels: np.ndarray
    dd: DataDependentAccount | None
    spent: EventTally = field(default_factory=EventTally)
    asked: int = 0
    answered: int = 0
    curve: list[tuple[int, int, float]] = field(default_factory=list)
    released_curve: list[tuple[int, int, float]] = field(default_factory=list)
    released: float | None = None
    asked_at_release: int = 0

    def ask(self, counts: np.ndarray) -> None:
        """Answer the next query; the events it spent go to the tally (checked against the plan)."""
        agg, secure = self.s.aggregator, self.rng.secure
        ans = agg.answer(counts, self.rng)
        if any(e not in self.plan.query_events for e in ans.events):
            raise RuntimeError(  # an aggregator that breaks its own contract
                f"{agg.name} spent {ans.events}, not the planned {self.plan.query_events}; "
                "report this as a bug"
            )
        self.spent.add(ans.events)
        if self.dd is not None:
            agg.account_data_dependent(self.dd, counts, ans, secure)
        if ans.label is not None:
            self.labels[self.asked] = ans.label
            self.answered += 1
        self.asked += 1

    def path_epsilon(self) -> float:
        """The data-independent ε of the events spent so far (the path; not a guarantee)."""
        s = self.s
        return s.aggregator.epsilon_of(self.spent, s.delta, s.accountant, np.zeros_like(ORDERS))

    def release(self) -> float:
        """Release the data-dependent cost so far (paid for); returns its ε."""
        assert self.dd is not None and self.s.release is not None
        self.released = self.dd.release(self.rng)
        self.asked_at_release = self.asked
        level = max(self.released, 0.0) + self.dd.releases * self.plan.release_rdp_at_order
        eps = rdp_to_epsilon([self.s.release.order], [level], self.s.delta)
        self.released_curve.append((self.answered, self.asked, eps))
        return eps


def _next_chunk(run: _Labelling, last: bool) -> int:
    """Data-dependent budget: release, then size the next chunk from released values only (per-query
    cost predicted as twice the released average, never above the worst case)."""
    s, plan = run.s, run.plan
    assert run.dd is not None and s.release is not None
    run.release()
    if last:
        return 0
    level = max(run.released or 0.0, 0.0)
    worst = s.release.order * (plan.rho_threshold + plan.rho_answer)
    guess = min(2.0 * level / run.asked, worst)
    full = min(s.check_every, plan.max_queries - run.asked)
    return _chunk(level, guess, run.dd.releases + 1, plan.release_rdp_at_order, s.release.order, s, full)


def _ask_all(run: _Labelling, hist: np.ndarray) -> str:
    """Ask queries in order until the budget or the queries run out; returns the stop reason."""
    s, plan = run.s, run.plan
    q_max = plan.max_queries
    every = max(1, q_max // 60)
    # Data-dependent budget: the first chunk fits the target by its worst-case cost (from the plan).
    next_release = plan.max_answers if s.budget == "data-dependent" else -1
    last_chunk = False
    stop = "all queries asked"
    while run.asked < q_max:
        if plan.rule is not None and not plan.rule.allows_another(run.spent):
            stop = "budget spent"
            break
        if run.asked == next_release:
            full = min(s.check_every, q_max - run.asked)
            chunk = _next_chunk(run, last_chunk)
            if chunk == 0:
                stop = "budget spent (released data-dependent ε)"
                break
            last_chunk = chunk < full  # a shortened chunk is the last one
            next_release = run.asked + chunk
        run.ask(hist[run.asked])
        if run.asked % every == 0 or run.asked == q_max:
            run.curve.append((run.answered, run.asked, run.path_epsilon()))
    if not run.curve or run.curve[-1][1] != run.asked:
        run.curve.append((run.answered, run.asked, run.path_epsilon()))
    return stop


def _worst_case_epsilon(run: _Labelling) -> float:
    """The data-independent ε: the budget rule's guarantee, or (data-dependent budget) every query
    asked at its worst case plus the most releases that can happen."""
    s, plan = run.s, run.plan
    if plan.rule is not None:
        return plan.rule.epsilon(run.spent, plan.max_queries)
    return planned_epsilon(s, plan)


def planned_epsilon(settings: LabelSettings, plan: BudgetPlan) -> float:
    """The most data-independent ε a run of ``plan`` can spend, from public parameters only (what the
    budget registry reserves): the target for the data-independent and PTR budgets (both stop within
    it), and for the data-dependent budget every query asked at its worst case plus the most releases
    that can happen (usually far above the target, see the module docstring)."""
    s = settings
    if s.budget != "data-dependent":
        return s.epsilon
    max_releases = math.ceil(plan.max_queries / s.check_every) + 2
    per_query = EventTally.of((e, 1) for e in plan.query_events).rdp()
    return rdp_epsilon(plan.max_queries * per_query + max_releases * plan.release_rdp, s.delta)


def label_queries(histograms: np.ndarray, settings: LabelSettings, rng: RandomSource) -> LabelResult:
    """Answer queries ``0, 1, …`` (rows of ``histograms``) until the budget or the queries run out."""
    s = settings
    hist = _check_histograms(histograms, s)
    if s.budget == "ptr":
        return label_ptr(hist, s, rng)
    plan = plan_budget(s, rng.secure, hist.shape[0])
    release = s.release if s.uses_release else None
    dd = DataDependentAccount(s.num_teachers, s.num_classes, release) if release is not None else None
    run = _Labelling(s, plan, rng, np.full(plan.max_queries, -1, dtype=np.int64), dd)
    stop = _ask_all(run, hist)
    eps_dd: float | None = None
    if dd is not None:
        if run.released is None or run.asked > run.asked_at_release:
            run.release()
        eps_dd = run.released_curve[-1][2]
    eps_di = _worst_case_epsilon(run)
    if eps_dd is not None:
        # The worst-case bound also bounds the per-instance loss: never report a larger one.
        eps_dd = min(eps_dd, eps_di)
    return LabelResult(
        labels=run.labels[: run.asked],
        queries_asked=run.asked,
        queries_answered=run.answered,
        epsilon_data_independent=eps_di,
        epsilon_data_dependent=eps_dd,
        guarantee=s.budget,
        stop_reason=stop,
        released_rdp=run.released,
        release_order=release.order if release is not None else None,
        releases=dd.releases if dd is not None else 0,
        release_rdp_per_release=plan.release_rdp_at_order if release is not None else None,
        answer_event=plan.answer_event.to_dict(),
        threshold_event=plan.threshold_event.to_dict() if plan.threshold_event is not None else None,
        epsilon_curve=run.curve,
        released_curve=run.released_curve,
    )
