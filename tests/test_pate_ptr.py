"""Propose-Test-Release for PATE (``veil.pate.ptr``): each test would fail if the guarantee broke.

* the distance d̂ has sensitivity 1 (random and adversarial one-teacher changes), because the
  bounds ``F_k`` are nested: ``F_k(D') ≤ F_{k+1}(D)``;
* ``F_k`` is at least the exact maximum over every histogram reachable with k changed teachers
  (brute force on tiny ensembles), and equals the data-dependent bound at k = 0;
* the test passes with probability ≤ δ_t when d̂ ≤ 1, and a failing test releases no label;
* the (ε, δ) arithmetic against a hand computation and against dp-accounting.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from veil.errors import ConfigError, UnreachableTargetError
from veil.mechanisms import SeededSource
from veil.pate.aggregators import Aggregator
from veil.pate.analysis import data_dependent_rdp, log_q_noisy_max
from veil.pate.label_settings import LabelSettings
from veil.pate.labelling import label_queries
from veil.pate.ptr import plan_ptr, ptr_bound_at_distance, ptr_distance, ptr_test, sorted_gaps

LAM = 6.0


def _hist(votes: np.ndarray, c: int) -> np.ndarray:
    """Histograms (queries × classes) from a teachers × queries vote matrix."""
    return np.stack([np.bincount(votes[:, q], minlength=c) for q in range(votes.shape[1])])


def _all_f(hist: np.ndarray, k_total: int, sigma: float) -> np.ndarray:
    g = sorted_gaps(hist)
    return np.array(
        [ptr_bound_at_distance(g, k, sigma, sigma / math.sqrt(2), LAM) for k in range(k_total + 2)]
    )


def _distance(hist: np.ndarray, k_total: int, sigma: float, bound: float) -> float:
    return ptr_distance(sorted_gaps(hist), bound, k_total, sigma, sigma / math.sqrt(2), LAM)


# -- (a) sensitivity of d̂ -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_distance_has_sensitivity_one_under_random_and_adversarial_teacher_changes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k_total, c, m, sigma = 30, 4, 12, 3.0
    # Teachers that mostly agree with a per-query truth, so d̂ lands mid-range.
    truth = rng.integers(0, c, m)
    votes = np.where(rng.random((k_total, m)) < 0.8, truth, rng.integers(0, c, (k_total, m)))
    hist = _hist(votes, c)
    f = _all_f(hist, k_total, sigma)
    assert np.all(np.diff(f) >= 0)  # non-decreasing in k
    for bound in (f[3] * 1.01, f[6] * 1.01, f[7] * 1.001, 0.5 * (f[0] + f[1])):
        d = _distance(hist, k_total, sigma, bound)
        changes = []
        for _ in range(15):  # one teacher re-votes arbitrarily on every query
            v = votes.copy()
            v[rng.integers(k_total)] = rng.integers(0, c, m)
            changes.append(v)
        for t in range(3):  # adversarial: a top-class voter moves to the runner-up everywhere
            v = votes.copy()
            srt = np.argsort(-hist, axis=1, kind="stable")
            v[t] = np.where(v[t] == srt[:, 0], srt[:, 1], srt[:, 1])
            changes.append(v)
        for v in changes:
            h2 = _hist(v, c)
            f2 = _all_f(h2, k_total, sigma)
            assert np.all(f2[:-1] <= f[1:] * (1 + 1e-12)) and np.all(f[:-1] <= f2[1:] * (1 + 1e-12))
            d2 = _distance(h2, k_total, sigma, bound)
            assert abs(d2 - d) <= 1 or (math.isinf(d) and math.isinf(d2))


# -- (b) F_k against brute force ------------------------------------------------------------------
def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, comp = -1, []
        for cut in cuts:
            comp.append(cut - prev - 1)
            prev = cut
        comp.append(total + parts - 2 - prev)
        out.append(tuple(comp))
    return out


@pytest.mark.parametrize(("k_total", "c", "sigma"), [(6, 3, 0.8), (7, 2, 1.0), (5, 4, 0.6), (8, 3, 1.5)])
def test_bound_at_distance_covers_every_reachable_histogram(k_total: int, c: int, sigma: float) -> None:
    z = sigma / math.sqrt(2)
    comps = np.array(_compositions(k_total, c))
    f_all = data_dependent_rdp(log_q_noisy_max(comps, sigma), z, LAM)  # Thm 6 at every histogram
    for h in comps:
        moved = np.maximum(comps - h, 0).sum(axis=1)  # teachers that must change to reach each one
        g = sorted_gaps(h[None, :])
        assert ptr_bound_at_distance(g, 0, sigma, z, LAM) == pytest.approx(float(f_all[moved == 0][0]))
        for k in range(0, k_total + 1):
            exact = float(np.max(f_all[moved <= k]))
            ours = ptr_bound_at_distance(g, k, sigma, z, LAM)
            assert ours >= exact * (1 - 1e-12)
            if c == 2 and int(g[0, 0]) >= 2 * k:  # two classes: moving k votes top → other is exact
                assert ours == pytest.approx(exact, rel=1e-9)


# -- (c) the test, and no label on failure ---------------------------------------------------------
def test_pass_probability_is_at_most_delta_t_when_the_distance_is_one() -> None:
    plan = plan_ptr(2.0, 0.2, threshold_rho=None, available_queries=10)  # δ_t = 0.1: measurable
    t = plan.laplace_scale
    exact = math.exp(-(plan.tau - 1) / t) / (1 + math.exp(-1 / t))  # Pr[Z ≥ τ − 1]
    assert (
        exact <= plan.delta_test and math.exp(-(plan.tau - 2) / t) / (1 + math.exp(-1 / t)) > plan.delta_test
    )
    rng = SeededSource(7)
    n = 3000
    passes = sum(ptr_test(1.0, plan, rng) for _ in range(n))
    # Binomial(3000, ≤ 0.1): mean ≤ 300, sd ≤ 16.4; 300 + 5 sd = 382 is exceeded w.p. < 1e-6.
    assert passes <= 382
    # and a distance far above τ passes (fails w.p. e^{-(d−τ+1)/t}/(1+e^{-1/t}) < 1e-8 here)
    assert all(ptr_test(plan.tau + 20 * t, plan, rng) for _ in range(20))


def _settings(agg: Aggregator, k_total: int, eps: float = 3.0, **kw: object) -> LabelSettings:
    return LabelSettings(
        aggregator=agg,
        epsilon=eps,
        delta=1e-5,
        max_queries=200,
        num_teachers=k_total,
        num_classes=10,
        budget="ptr",
        **kw,  # type: ignore[arg-type]
    )


def test_a_failing_test_releases_no_label_and_still_charges_epsilon() -> None:
    k_total = 250
    hist = np.zeros((200, 10), dtype=np.int64)
    hist[:, 0], hist[:, 1] = 126, 124  # split votes: d̂ = 0 (F_0 is already the worst case)
    for agg in (
        Aggregator("gnmax", 20.0),
        Aggregator("confident-gnmax", 20.0, threshold=100.0, sigma1=150.0),
    ):
        for seed in range(5):
            res = label_queries(hist, _settings(agg, k_total), SeededSource(seed))
            assert res.ptr is not None and res.ptr["passed"] is False
            assert res.queries_answered == 0 and np.all(res.labels == -1)
            assert res.guarantee == "ptr" and res.epsilon == pytest.approx(3.0, rel=1e-9)
            assert "no label" in res.stop_reason


def test_a_clear_consensus_passes_and_releases_the_plurality() -> None:
    hist = np.zeros((150, 10), dtype=np.int64)
    hist[np.arange(150), np.arange(150) % 10] = 250  # unanimous
    res = label_queries(hist, _settings(Aggregator("gnmax", 20.0), 250), SeededSource(3))
    # d̂ ≈ 110 while τ = 41 and t = 10/3: the test fails w.p. < e^{−20} (a false failure).
    assert res.ptr is not None and res.ptr["passed"] is True
    assert res.queries_answered == 150 and np.array_equal(res.labels, np.arange(150) % 10)
    assert res.epsilon == pytest.approx(3.0, rel=1e-9) and res.epsilon_data_dependent is None
    assert res.epsilon_data_independent > res.epsilon  # 150 answers at σ = 20 cost far more worst-case


def test_ptr_needs_a_data_dependent_aggregator() -> None:
    with pytest.raises(ConfigError, match="budget"):
        _settings(Aggregator("lnmax", 20.0), 250)


# -- (d) ε arithmetic --------------------------------------------------------------------------------
def test_plan_arithmetic_matches_a_hand_computation() -> None:
    # GNMax, ε = 2, δ = 1e-5, test share 0.1: ε_t = 0.2 (t = 5), δ_t = δ/2 = 5e-6,
    # τ = 1 + ⌈5·ln(1/(5e-6·(1 + e^{−0.2})))⌉ = 1 + ⌈58.04⌉ = 60.
    p = plan_ptr(2.0, 1e-5, threshold_rho=None, available_queries=100)
    assert p.laplace_scale == 5.0 and p.eps_test == pytest.approx(0.2, rel=1e-12)
    assert p.tau == 60 and p.checks == 0 and p.eps_select == 0.0
    d_p = 5e-6 / math.exp(0.2)
    assert p.delta_release == pytest.approx(d_p, rel=1e-9)
    lam = round(2 * (1 + 2 * math.log(1 / d_p) / 1.8)) / 2  # λ = 1 + 2 ln(1/δ_p)/ε_p, to ½
    assert p.order == lam == 15.0
    # ε_p = B + ln(1 − 1/λ) − (ln δ_p + ln λ)/(λ − 1) = 1.8 exactly at the largest B
    b = 1.8 - math.log(1 - 1 / lam) + (math.log(d_p) + math.log(lam)) / (lam - 1)
    assert p.bound == pytest.approx(b, rel=1e-12)
    assert p.epsilon == pytest.approx(2.0, rel=1e-12) and p.delta == pytest.approx(1e-5, rel=1e-9)
    assert p.delta <= 1e-5 and p.epsilon <= 2.0 + 1e-12


def test_selection_epsilon_against_dp_accounting() -> None:
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    sigma1 = 150.0
    p = plan_ptr(3.0, 1e-5, threshold_rho=1 / (2 * sigma1**2), available_queries=9000)
    assert p.delta_select == p.delta_test == 2.5e-6
    assert p.eps_select <= 0.3 * 3.0 + 1e-12 and 0 < p.checks < 9000
    acc = RdpAccountant(orders=[1 + x / 10 for x in range(1, 100)] + list(range(11, 257)))
    acc.compose(SelfComposedDpEvent(GaussianDpEvent(sigma1), p.checks))
    ref = acc.get_epsilon(p.delta_select)
    assert p.eps_select <= ref * 1.001 and p.eps_select >= ref * 0.95  # ours converts a bit tighter
    total = p.eps_select + p.eps_test + p.eps_release
    assert p.epsilon == pytest.approx(total) and p.epsilon <= 3.0 + 1e-12
    assert p.delta == pytest.approx(p.delta_select + math.exp(p.eps_test) * p.delta_release + p.delta_test)
    with pytest.raises(UnreachableTargetError):
        plan_ptr(0.001, 1e-5, threshold_rho=1 / (2 * 0.5**2), available_queries=10)


def test_a_failed_ptr_run_reports_the_ptr_guarantee_and_trains_no_student(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from veil.cli.main import main

    # 20 teachers: d̂ ≤ 10 < τ = 16, so the test fails (pass probability ≤ δ_t = 5e-6).
    out = tmp_path / "p"
    argv = ["pate", "--dataset", "digits", "--teachers", "20", "--sigma", "3", "--epsilon", "8"]
    argv += ["--queries", "40", "--budget", "ptr", "--no-semi-supervised", "--out", str(out), "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pate"]["guarantee"] == "ptr" and r["epsilon"] == pytest.approx(8.0) and r["budget"] == "ptr"
    assert r["ptr"]["passed"] is False and r["queries_answered"] == 0
    assert r["non_private"]["student_test_accuracy"] is None
    assert not (out / "student.model").exists() and "no label was released" in r["guarantee_statement"]
    assert np.load(out / "labels.npz")["label"].size == 0
    assert r["epsilon_data_independent"] > r["epsilon"] and r["epsilon_data_dependent"] is None
