"""Answering the student's queries within a privacy budget, with both ε computed and stated.

:func:`label_queries` asks queries in their (public) order, answers each with the aggregator, and
stops when the budget is spent. What it returns is the whole privacy-relevant output: the labels
(or "not answered") and, for GNMax/Confident-GNMax, the privately released data-dependent cost.

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
from typing import Any, Literal

import numpy as np

from veil.accounting.events import Gaussian, PrivacyEvent
from veil.accounting.rdp import rdp_to_epsilon
from veil.errors import ConfigError, InvalidParameterError
from veil.mechanisms.rng import RandomSource
from veil.pate.aggregators import Aggregator, ConfidentGNMax, GNMax
from veil.pate.ptr import PtrPlan, plan_ptr, ptr_distance, ptr_test, sorted_gaps
from veil.pate.smooth_sensitivity import DataDependentAccount, ReleaseParams
from veil.pate.spending import (
    ORDERS,
    DataIndependentBudget,
    EventTally,
    largest,
    rdp_epsilon,
    rdp_of,
    rho_of,
    too_small,
)

__all__ = [
    "BudgetName",
    "BudgetPlan",
    "LabelResult",
    "LabelSettings",
    "default_release_params",
    "label_queries",
    "plan_budget",
]

BudgetName = Literal["data-independent", "data-dependent", "ptr"]


def default_release_params(epsilon: float, delta: float, confidence: float = 0.95) -> ReleaseParams:
    """Public defaults for the release: ``λ = 1 + 2·ln(1/δ)/ε`` (half the budget to the conversion),
    ``β`` half of its largest valid value at λ, ``σ_s = 8``."""
    lam = float(min(100.0, max(2.0, round(2.0 * (1.0 + 2.0 * math.log(1.0 / delta) / epsilon)) / 2.0)))
    beta = 0.5 * 0.5 * math.log1p(1.0 / (lam - 1.0))
    return ReleaseParams(order=lam, beta=beta, sigma_s=8.0, confidence=confidence)


@dataclass(frozen=True)
class LabelSettings:
    """The privacy settings of one labelling run (all public)."""

    aggregator: Aggregator
    epsilon: float
    delta: float
    max_queries: int
    num_teachers: int
    num_classes: int
    budget: BudgetName = "data-independent"
    accountant: Literal["pld", "rdp"] = "pld"
    data_dependent: bool = True
    release: ReleaseParams | None = None
    check_every: int = 50
    ptr_test_share: float = 0.1
    """PTR: share of ε spent on the test (``ε_t``)."""
    ptr_select_share: float = 0.3
    """PTR with Confident-GNMax: the most of ε the (data-independent) threshold checks may use."""
    ptr_order: float | None = None
    """PTR: the Rényi order λ of the proposed bound (default from ε and δ, see :mod:`veil.pate.ptr`)."""
    ptr_max_answers: int | None = None
    """PTR: answer at most this many of the selected queries (in order; default all)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.epsilon, (int, float)) and math.isfinite(self.epsilon) and self.epsilon > 0):
            raise InvalidParameterError(
                "epsilon", self.epsilon, "the target ε must be finite and > 0", "pass ε > 0"
            )
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise InvalidParameterError(
                "delta", self.delta, "δ is a probability of failure in (0, 1)", "pass δ well below 1/N"
            )
        if (
            isinstance(self.max_queries, bool)
            or not isinstance(self.max_queries, int)
            or self.max_queries < 1
        ):
            raise InvalidParameterError(
                "queries", self.max_queries, "the student needs at least one query", "pass an integer ≥ 1"
            )
        if self.budget not in ("data-independent", "data-dependent", "ptr"):
            raise ConfigError(
                "budget", self.budget, "unknown budget", "use 'data-independent', 'data-dependent' or 'ptr'"
            )
        if self.budget == "ptr" and not self.aggregator.has_data_dependent_analysis:
            raise ConfigError(
                "budget",
                self.budget,
                "Propose-Test-Release tests the data-dependent analysis, which exists for GNMax and "
                "Confident-GNMax only",
                "use gnmax or confident-gnmax, or budget='data-independent'",
            )
        if self.ptr_max_answers is not None and (
            isinstance(self.ptr_max_answers, bool)
            or not isinstance(self.ptr_max_answers, int)
            or self.ptr_max_answers < 1
        ):
            raise InvalidParameterError(
                "ptr_max_answers", self.ptr_max_answers, "a number of answers", "pass an integer ≥ 1"
            )
        if self.budget == "data-dependent" and not (
            self.aggregator.has_data_dependent_analysis and self.data_dependent
        ):
            raise ConfigError(
                "budget",
                self.budget,
                "a data-dependent budget needs the data-dependent analysis, which exists for GNMax and "
                "Confident-GNMax only (and must be enabled)",
                "use gnmax or confident-gnmax with data_dependent on, or budget='data-independent'",
            )
        if (
            isinstance(self.check_every, bool)
            or not isinstance(self.check_every, int)
            or self.check_every < 1
        ):
            raise InvalidParameterError(
                "dd_check_every",
                self.check_every,
                "releases happen every so many queries",
                "pass an integer ≥ 1",
            )

    @property
    def uses_release(self) -> bool:
        """Whether the data-dependent ε is released by smooth sensitivity (never with PTR, whose test
        replaces it)."""
        return self.data_dependent and self.aggregator.has_data_dependent_analysis and self.budget != "ptr"


@dataclass
class LabelResult:
    """Labels (−1: not answered) for the first ``queries_asked`` queries, and the privacy spent."""

    labels: np.ndarray
    queries_asked: int
    queries_answered: int
    epsilon_data_independent: float
    epsilon_data_dependent: float | None
    guarantee: BudgetName
    stop_reason: str
    released_rdp: float | None = None
    release_order: float | None = None
    releases: int = 0
    release_rdp_per_release: float | None = None
    answer_event: dict[str, Any] = field(default_factory=dict)
    threshold_event: dict[str, Any] | None = None
    epsilon_curve: list[tuple[int, int, float]] = field(default_factory=list)
    """(queries answered, queries asked, data-independent ε of the path so far — not a guarantee)."""
    released_curve: list[tuple[int, int, float]] = field(default_factory=list)
    """(answered, asked, released data-dependent ε) at each release."""
    epsilon_ptr: float | None = None
    """PTR budget: the ε of the Propose-Test-Release guarantee (see :mod:`veil.pate.ptr`)."""
    ptr: dict[str, Any] | None = None
    """PTR budget: the public plan, the selection size and whether the test passed."""

    @property
    def epsilon(self) -> float:
        """The ε of the guarantee. PTR budget: the PTR ε (a worst-case (ε, δ)-DP guarantee). Otherwise
        the data-independent ε, the only other bound that holds for every dataset (a data-dependent
        budget decides when to stop, it does not replace it)."""
        return self.epsilon_ptr if self.epsilon_ptr is not None else self.epsilon_data_independent


@dataclass(frozen=True)
class BudgetPlan:
    """What the budget allows, computed from public settings only (no votes)."""

    max_queries: int
    max_answers: int
    """LNMax/GNMax, data-independent budget: answers that fit the target. Data-dependent budget: the
    size of the first chunk (its worst-case cost fits the target). Else ``max_queries``."""
    rho_max: float
    """Confident-GNMax, data-independent budget: the Rényi filter's cap (else inf)."""
    rho_threshold: float
    rho_answer: float
    answer_event: PrivacyEvent
    threshold_event: Gaussian | None
    answer_rdp: np.ndarray
    release_rdp: np.ndarray
    release_rdp_at_order: float
    query_events: tuple[PrivacyEvent, ...] = ()
    """Every event one query may spend (the aggregator's worst case)."""
    rule: DataIndependentBudget | None = None
    """Data-independent budget: the stopping rule and the guarantee it gives."""


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
        _ptr_plan(s, secure, q_max)
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


def _ptr_plan(s: LabelSettings, secure: bool, available: int) -> PtrPlan:
    events = s.aggregator.query_events(secure)
    return plan_ptr(
        s.epsilon,
        s.delta,
        threshold_rho=rho_of(events[0]) if len(events) > 1 else None,
        available_queries=available,
        test_share=s.ptr_test_share,
        select_share=s.ptr_select_share,
        order=s.ptr_order,
    )


def _ptr_select(
    hist: np.ndarray, s: LabelSettings, plan: PtrPlan, rng: RandomSource
) -> tuple[int, np.ndarray, EventTally]:
    """PTR step 1: the queries asked, those selected, and the events the selection spent. GNMax: the
    first queries (a fixed set); Confident-GNMax: the threshold checks, accounted data-independently."""
    agg = s.aggregator
    q_max = min(s.max_queries, hist.shape[0])
    spent = EventTally()
    if isinstance(agg, ConfidentGNMax):
        asked = plan.checks
        selected = []
        for i in range(asked):
            passed, event = agg.threshold_check(hist[i], rng)
            spent.add((event,))
            if passed:
                selected.append(i)
    else:
        asked = min(q_max, s.ptr_max_answers or q_max)
        selected = list(range(asked))
    if s.ptr_max_answers is not None:
        selected = selected[: s.ptr_max_answers]
    return asked, np.asarray(selected, dtype=np.int64), spent


def _label_ptr(hist: np.ndarray, s: LabelSettings, rng: RandomSource) -> LabelResult:
    """Propose-Test-Release (:mod:`veil.pate.ptr`): select, test privately, release all or nothing."""
    agg = s.aggregator
    secure = rng.secure
    plan = _ptr_plan(s, secure, min(s.max_queries, hist.shape[0]))
    ans_event = agg.answer_event(secure)
    assert isinstance(ans_event, Gaussian)
    asked, sel, spent = _ptr_select(hist, s, plan, rng)
    # 2. Test (only the bit is published) and 3. release (GNMax with the aggregator's σ).
    lattice = agg.answer_lattice(secure)
    gaps = sorted_gaps(hist[sel])
    nm = ans_event.noise_multiplier
    distance = ptr_distance(gaps, plan.bound, s.num_teachers, agg.scale, nm, plan.order, lattice)
    passed = ptr_test(distance, plan, rng)
    labels = np.full(asked, -1, dtype=np.int64)
    if passed:
        answerer = GNMax(agg.scale)
        for i in sel:
            ans = answerer.answer(hist[i], rng)
            assert ans.label is not None
            labels[i] = ans.label
    answered = int(sel.size) if passed else 0
    # The data-independent bound of the same mechanism (whatever the test's outcome): the checks
    # spent and one answer per selected query (RDP), plus the pure ε_t of the test by basic
    # composition (the discrete Laplace is ε_t-DP, not the continuous Laplace the RDP accountant models).
    worst = EventTally.of([*spent, (ans_event, int(sel.size))])
    eps_di = worst.epsilon("rdp", s.delta) + plan.eps_test
    stop = (
        f"PTR test passed: {answered} labels released"
        if passed
        else "PTR test failed: no label released (the ε is spent all the same)"
    )
    return LabelResult(
        labels=labels,
        queries_asked=asked,
        queries_answered=answered,
        epsilon_data_independent=eps_di,
        epsilon_data_dependent=None,
        guarantee="ptr",
        stop_reason=stop,
        answer_event=ans_event.to_dict(),
        threshold_event=agg.query_events(secure)[0].to_dict() if isinstance(agg, ConfidentGNMax) else None,
        epsilon_curve=[(answered, asked, plan.epsilon)],
        epsilon_ptr=plan.epsilon,
        ptr=plan.to_dict() | {"selected": int(sel.size), "passed": bool(passed)},
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
    if hist.shape[0] and np.any(hist.sum(axis=1) != s.num_teachers):
        raise InvalidParameterError(
            "histograms",
            "row sums",
            "every teacher votes once per query; the analysis assumes histograms summing to K",
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
        return _label_ptr(hist, s, rng)
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
