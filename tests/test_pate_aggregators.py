"""The aggregator objects: one interface, events spent as planned, budgets read from those events.

The noise distributions and the budgets' correctness against dp-accounting are tested in
``test_pate_analysis.py``; here, the contract every aggregator shares.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from veil.accounting.events import Gaussian
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.pate.aggregators import (
    Aggregator,
    Answer,
    ConfidentGNMax,
    GNMax,
    LNMax,
    make_aggregator,
)
from veil.pate.label_settings import LabelSettings
from veil.pate.labelling import label_queries
from veil.pate.spending import EventTally

AGGS = [LNMax(3.0), GNMax(4.0), ConfidentGNMax(4.0, threshold=12.0, sigma1=5.0)]


def _hists(n: int, k: int = 20, c: int = 4, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((n, c), dtype=np.int64)
    for i in range(n):
        out[i] = np.bincount(rng.choice(c, size=k, p=[0.7, 0.1, 0.1, 0.1]), minlength=c)
    return out


def test_the_name_keyed_constructor_builds_each_class_and_its_defaults() -> None:
    assert Aggregator("lnmax", 2.0) == LNMax(2.0)
    assert Aggregator("gnmax", 2.0) == GNMax(2.0)
    assert Aggregator("confident-gnmax", 2.0, 5.0, 1.0) == ConfidentGNMax(2.0, 5.0, 1.0)
    k = 50
    assert make_aggregator("lnmax", None, num_teachers=k) == LNMax(0.08 * k)
    assert make_aggregator("gnmax", None, num_teachers=k) == GNMax(0.16 * k)
    assert make_aggregator("confident-gnmax", None, num_teachers=k) == ConfidentGNMax(
        0.16 * k, 0.8 * k, 0.6 * k
    )
    with pytest.raises(Exception, match="threshold"):
        make_aggregator("confident-gnmax", 1.0)  # no threshold and no K to default it from
    with pytest.raises(Exception, match="scale"):
        GNMax(-1.0)


@pytest.mark.parametrize("agg", AGGS, ids=lambda a: a.name)
@pytest.mark.parametrize("secure", [False, True])
def test_every_answer_spends_only_the_planned_events(agg: Aggregator, secure: bool) -> None:
    rng = SecureSource() if secure else SeededSource(0)
    planned = agg.query_events(secure)
    answered = unanswered = 0
    for counts in _hists(40):
        ans = agg.answer(counts, rng)
        assert set(ans.events) <= set(planned)
        if ans.label is None:
            unanswered += 1
            assert ans.events == planned[:1]  # only the threshold check
        else:
            answered += 1
            assert 0 <= ans.label < 4 and ans.events[-1] == agg.answer_event(secure)
    assert answered > 0
    assert (unanswered > 0) == isinstance(agg, ConfidentGNMax)


def test_the_tally_counts_events_and_sums_rho_in_order() -> None:
    a, b = Gaussian(2.0), Gaussian(3.0)
    tally = EventTally()
    tally.add([a, b])
    tally.add([a])
    assert tally.count(a) == 2 and tally.count(b) == 1 and tally.count(Gaussian(9.0)) == 0
    assert tally.rho == pytest.approx(2 / 8 + 1 / 18)
    assert np.allclose(tally.rdp(), EventTally.of([(a, 2), (b, 1)]).rdp())


def test_lnmax_budget_reads_the_spent_events_and_matches_dp_accounting() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    agg = LNMax(4.0)
    s = LabelSettings(agg, 3.0, 1e-5, 200, 20, 4)
    res = label_queries(_hists(200), s, SeededSource(1))
    n = res.queries_answered
    assert 0 < n < 200 and res.stop_reason == "budget spent" and res.epsilon <= 3.0
    ev = agg.answer_event(False)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.LaplaceDpEvent(ev.scale / ev.sensitivity), n)  # type: ignore[attr-defined]
    reference = pld.get_epsilon(1e-5)
    assert res.epsilon == pytest.approx(reference, rel=1e-3)


def test_an_answer_spending_an_unplanned_event_stops_the_run() -> None:
    class Leaky(GNMax):
        """Answers with half the noise it plans for: a budget read from planned costs would not see it."""

        def answer(self, counts: np.ndarray | list[int], rng: object) -> Answer:  # type: ignore[override]
            ans = super().answer(counts, rng)  # type: ignore[arg-type]
            return Answer(ans.label, (Gaussian(self.answer_event(False).noise_multiplier / 2),))

    s = LabelSettings(Leaky(4.0), 3.0, 1e-5, 50, 20, 4, data_dependent=False)
    with pytest.raises(RuntimeError, match="not the planned"):
        label_queries(_hists(50), s, SeededSource(2))


def test_confident_filter_stops_where_the_next_worst_case_query_would_pass_rho_max() -> None:
    agg = ConfidentGNMax(8.0, threshold=12.0, sigma1=10.0)
    s = LabelSettings(agg, 3.0, 1e-5, 400, 20, 4, data_dependent=False)
    res = label_queries(_hists(400), s, SeededSource(3))
    assert res.stop_reason == "budget spent"
    rho_t = 1 / (2 * agg.threshold_event(False).noise_multiplier ** 2)
    rho_a = 1 / (2 * agg.answer_event(False).noise_multiplier ** 2)
    spent = res.queries_asked * rho_t + res.queries_answered * rho_a
    budget = agg.data_independent_budget(3.0, 1e-5, "rdp", np.zeros(len(EventTally().rdp())), 400, False)
    assert spent <= budget.rho_max < spent + rho_t + rho_a + 1e-12
    assert res.queries_answered < res.queries_asked
    assert math.isfinite(res.epsilon) and res.epsilon <= 3.0 + 1e-9
