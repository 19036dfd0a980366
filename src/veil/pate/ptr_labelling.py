"""PATE labelling under a Propose-Test-Release budget (:mod:`veil.pate.ptr` holds the test itself).

Three steps: select the queries (GNMax: the first ones, a fixed set; Confident-GNMax: those passing
the threshold checks, accounted data-independently), test privately that the selection's
data-dependent cost is within the proposed bound (only the bit is published), then release GNMax
answers for every selected query or none. The guarantee is the PTR ε of the plan, worst case over
all datasets (see :mod:`veil.pate.ptr`); the data-independent bound of the same mechanism is
reported beside it.
"""

from __future__ import annotations

import numpy as np

from veil.accounting.events import Gaussian
from veil.mechanisms.rng import RandomSource
from veil.pate.aggregators import ConfidentGNMax, GNMax
from veil.pate.label_settings import LabelResult, LabelSettings
from veil.pate.ptr import PtrPlan, plan_ptr, ptr_distance, ptr_test, sorted_gaps
from veil.pate.spending import EventTally, rho_of

__all__ = ["label_ptr", "ptr_plan"]


def ptr_plan(s: LabelSettings, secure: bool, available: int) -> PtrPlan:
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


def label_ptr(hist: np.ndarray, s: LabelSettings, rng: RandomSource) -> LabelResult:
    """Propose-Test-Release (:mod:`veil.pate.ptr`): select, test privately, release all or nothing."""
    agg = s.aggregator
    secure = rng.secure
    plan = ptr_plan(s, secure, min(s.max_queries, hist.shape[0]))
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
