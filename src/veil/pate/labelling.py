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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from veil.accounting.base import make_accountant
from veil.accounting.events import Gaussian, Laplace, PrivacyEvent
from veil.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from veil.errors import ConfigError, InvalidParameterError, UnreachableTargetError
from veil.mechanisms import gaussian_mechanism
from veil.mechanisms.rng import RandomSource
from veil.pate.aggregators import Aggregator, answer_query
from veil.pate.ptr import PtrPlan, plan_ptr, ptr_distance, ptr_test, sorted_gaps
from veil.pate.smooth_sensitivity import DataDependentAccount, ReleaseParams

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
_ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)


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
        if self.budget == "ptr" and self.aggregator.name == "lnmax":
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
        if self.budget == "data-dependent" and (self.aggregator.name == "lnmax" or not self.data_dependent):
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
        return self.data_dependent and self.aggregator.name != "lnmax" and self.budget != "ptr"


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


def _rdp_of(event: PrivacyEvent) -> np.ndarray:
    acc = make_accountant("rdp")
    acc.compose(event)
    return np.asarray(acc.rdp)  # type: ignore[attr-defined]


def _conv(rdp: np.ndarray, delta: float) -> float:
    return rdp_to_epsilon(DEFAULT_ORDERS, rdp, delta)


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with ok(n) (ok monotone, ok(0) assumed true)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _largest_rho(release: np.ndarray, target: float, delta: float) -> float:
    """The largest ρ with ε(α·ρ + release(α)) ≤ target (bisection, kept on the feasible side)."""
    if _conv(release, delta) > target:
        return 0.0
    lo, hi = 0.0, 1.0
    while _conv(_ORDERS * hi + release, delta) <= target:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return lo
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if _conv(_ORDERS * mid + release, delta) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def _too_small(s: LabelSettings, why: str) -> UnreachableTargetError:
    return UnreachableTargetError(
        "epsilon",
        s.epsilon,
        f"the budget is too small to answer even one query ({why})",
        "raise ε, or raise the aggregator's noise (fewer, noisier answers), or lower the release cost",
    )


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


def _chunk(
    level: float, per_query: float, releases: int, rel_lam: float, order: float, s: LabelSettings, most: int
) -> int:
    """Largest n ≤ most with ε_λ(level + n·per_query + releases·ε_ss(λ)) ≤ target."""
    return _largest(
        lambda n: rdp_to_epsilon([order], [level + n * per_query + releases * rel_lam], s.delta) <= s.epsilon,
        most,
    )


def plan_budget(settings: LabelSettings, secure: bool, available_queries: int | None = None) -> BudgetPlan:
    """The budget plan of ``settings``; raises :class:`~veil.errors.UnreachableTargetError` if not even
    one query fits. Depends on public parameters only, so it can run before any teacher is trained."""
    s = settings
    q_max = s.max_queries if available_queries is None else min(s.max_queries, available_queries)
    agg = s.aggregator
    ans_event = agg.answer_event(secure)
    thr_event = agg.threshold_event(secure) if agg.name == "confident-gnmax" else None
    release = s.release if s.uses_release else None
    if release is not None:
        rel_curve = release.rdp(_ORDERS)
        rel_lam = float(release.rdp(release.order)[0])
    else:
        rel_curve = np.zeros_like(_ORDERS)
        rel_lam = 0.0
    ans_rdp = _rdp_of(ans_event)
    rho2 = 1.0 / (2.0 * ans_event.noise_multiplier**2) if isinstance(ans_event, Gaussian) else math.nan
    rho1 = 1.0 / (2.0 * thr_event.noise_multiplier**2) if thr_event is not None else 0.0
    n_answers = q_max
    rho_max = math.inf
    if s.budget == "data-independent":
        if agg.name == "lnmax":
            assert isinstance(ans_event, Laplace)

            def fits(n: int) -> bool:
                return make_accountant(s.accountant).compose(ans_event, n).epsilon(s.delta) <= s.epsilon

            n_answers = _largest(fits, q_max)
            if n_answers == 0:
                raise _too_small(s, f"one LNMax answer with scale b={agg.scale:g} alone exceeds it")
        elif agg.name == "gnmax":
            n_answers = _largest(lambda n: _conv(n * ans_rdp + rel_curve, s.delta) <= s.epsilon, q_max)
            if n_answers == 0:
                raise _too_small(s, f"one GNMax answer with σ={agg.scale:g} plus the ε release exceeds it")
        else:
            rho_max = _largest_rho(rel_curve, s.epsilon, s.delta)
            if rho1 + rho2 > rho_max:
                raise _too_small(
                    s,
                    f"one Confident-GNMax query (σ₁={agg.sigma1:g}, σ₂={agg.scale:g}) plus the ε release "
                    "exceeds it",
                )
    elif s.budget == "ptr":
        _ptr_plan(s, secure, q_max)
    else:
        assert release is not None
        per_query = release.order * (rho1 + rho2)  # worst case of one query at λ (Gaussian events)
        first = _chunk(0.0, per_query, 1, rel_lam, release.order, s, min(s.check_every, q_max))
        if first == 0:
            raise _too_small(
                s, "the first chunk of queries must fit the target by its worst-case cost, and one does not"
            )
        n_answers = first
    return BudgetPlan(
        max_queries=q_max,
        max_answers=n_answers,
        rho_max=rho_max,
        rho_threshold=rho1,
        rho_answer=rho2,
        answer_event=ans_event,
        threshold_event=thr_event,
        answer_rdp=ans_rdp,
        release_rdp=rel_curve,
        release_rdp_at_order=rel_lam,
    )


def _ptr_plan(s: LabelSettings, secure: bool, available: int) -> PtrPlan:
    thr = s.aggregator.threshold_event(secure) if s.aggregator.name == "confident-gnmax" else None
    return plan_ptr(
        s.epsilon,
        s.delta,
        threshold_rho=1.0 / (2.0 * thr.noise_multiplier**2) if thr is not None else None,
        available_queries=available,
        test_share=s.ptr_test_share,
        select_share=s.ptr_select_share,
        order=s.ptr_order,
    )


def _label_ptr(hist: np.ndarray, s: LabelSettings, rng: RandomSource) -> LabelResult:
    """Propose-Test-Release (:mod:`veil.pate.ptr`): select, test privately, release all or nothing."""
    agg = s.aggregator
    secure = rng.secure
    q_max = min(s.max_queries, hist.shape[0])
    plan = _ptr_plan(s, secure, q_max)
    ans_event = agg.answer_event(secure)
    assert isinstance(ans_event, Gaussian)
    thr_event = agg.threshold_event(secure) if agg.name == "confident-gnmax" else None
    # 1. Selection: fixed queries (GNMax) or data-independently accounted threshold checks.
    if thr_event is not None:
        assert agg.sigma1 is not None and agg.threshold is not None
        asked = plan.checks
        selected = [
            i
            for i in range(asked)
            if float(gaussian_mechanism(float(hist[i].max()), sensitivity=1.0, std=agg.sigma1, rng=rng).value)
            >= agg.threshold
        ]
    else:  # the fixed query set: the first queries, at most ptr_max_answers of them
        asked = min(q_max, s.ptr_max_answers or q_max)
        selected = list(range(asked))
    if s.ptr_max_answers is not None:
        selected = selected[: s.ptr_max_answers]
    sel = np.asarray(selected, dtype=np.int64)
    # 2. Test (only the bit is published) and 3. release.
    lattice = agg.answer_lattice(secure)
    distance = ptr_distance(
        sorted_gaps(hist[sel]),
        plan.bound,
        s.num_teachers,
        agg.scale,
        ans_event.noise_multiplier,
        plan.order,
        lattice,
    )
    passed = ptr_test(distance, plan, rng)
    labels = np.full(asked, -1, dtype=np.int64)
    if passed:
        for i in sel:
            labels[i] = int(answer_query(Aggregator("gnmax", agg.scale), hist[i], rng).label)  # type: ignore[arg-type]
    answered = int(sel.size) if passed else 0
    # The data-independent bound of the same output: the checks and the answers (RDP), plus the
    # pure ε_t of the test by basic composition (the discrete Laplace is ε_t-DP, not the continuous
    # Laplace the RDP accountant models).
    acc = make_accountant("rdp")
    if thr_event is not None:
        acc.compose(thr_event, asked)
    if sel.size:
        acc.compose(ans_event, int(sel.size))
    eps_di = acc.epsilon(s.delta) + plan.eps_test
    stop = (
        f"PTR test passed: {answered} labels released"
        if passed
        else "PTR test failed: no label released (the ε is spent all the same)"
    )
    info = plan.to_dict() | {"selected": int(sel.size), "passed": bool(passed)}
    return LabelResult(
        labels=labels,
        queries_asked=asked,
        queries_answered=answered,
        epsilon_data_independent=eps_di,
        epsilon_data_dependent=None,
        guarantee="ptr",
        stop_reason=stop,
        answer_event=ans_event.to_dict(),
        threshold_event=thr_event.to_dict() if thr_event is not None else None,
        epsilon_curve=[(answered, asked, plan.epsilon)],
        epsilon_ptr=plan.epsilon,
        ptr=info,
    )


def label_queries(histograms: np.ndarray, settings: LabelSettings, rng: RandomSource) -> LabelResult:
    """Answer queries ``0, 1, …`` (rows of ``histograms``) until the budget or the queries run out."""
    s = settings
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
    if s.budget == "ptr":
        return _label_ptr(hist, s, rng)
    agg = s.aggregator
    secure = rng.secure
    plan = plan_budget(s, secure, hist.shape[0])
    q_max, n_answers, rho_max = plan.max_queries, plan.max_answers, plan.rho_max
    rho1, rho2 = plan.rho_threshold, plan.rho_answer
    ans_event, thr_event = plan.answer_event, plan.threshold_event
    ans_rdp, rel_curve, rel_lam = plan.answer_rdp, plan.release_rdp, plan.release_rdp_at_order
    release = s.release if s.uses_release else None
    dd = DataDependentAccount(s.num_teachers, s.num_classes, release) if release is not None else None
    gn_lattice, thr_lattice = agg.answer_lattice(secure), agg.threshold_lattice(secure)

    # -- the loop ----------------------------------------------------------------------------------
    labels = np.full(q_max, -1, dtype=np.int64)
    asked = answered = 0
    rho_spent = 0.0
    stop = "all queries asked"
    curve: list[tuple[int, int, float]] = []
    released_curve: list[tuple[int, int, float]] = []
    released: float | None = None
    asked_at_release = 0
    every = max(1, q_max // 60)
    # Data-dependent budget: the first chunk fits the target by its worst-case cost (from the plan).
    next_release = n_answers if s.budget == "data-dependent" else -1
    worst_per_query = release.order * (rho1 + rho2) if release is not None else math.inf
    last_chunk = False

    def do_release() -> float:
        nonlocal released, asked_at_release
        assert dd is not None and release is not None
        released = dd.release(rng)
        asked_at_release = asked
        eps = rdp_to_epsilon([release.order], [max(released, 0.0) + dd.releases * rel_lam], s.delta)
        released_curve.append((answered, asked, eps))
        return eps

    def path_epsilon() -> float:
        if agg.name == "lnmax":
            return make_accountant(s.accountant).compose(ans_event, answered).epsilon(s.delta)
        if agg.name == "gnmax":
            return _conv(answered * ans_rdp, s.delta)
        return _conv(_ORDERS * rho_spent, s.delta)

    while asked < q_max:
        if s.budget == "data-independent":
            if agg.name == "confident-gnmax":
                if rho_spent + rho1 + rho2 > rho_max:
                    stop = "budget spent"
                    break
            elif answered >= n_answers:
                stop = "budget spent"
                break
        elif asked == next_release:
            # Release, then size the next chunk from released values only: per-query cost
            # predicted as twice the released average, never above the worst case.
            assert dd is not None and release is not None
            do_release()
            level = max(released or 0.0, 0.0)
            guess = min(2.0 * level / asked, worst_per_query)
            full = min(s.check_every, q_max - asked)
            chunk = (
                0 if last_chunk else _chunk(level, guess, dd.releases + 1, rel_lam, release.order, s, full)
            )
            if chunk == 0:
                stop = "budget spent (released data-dependent ε)"
                break
            last_chunk = chunk < full  # a shortened chunk is the last one
            next_release = asked + chunk
        counts = hist[asked]
        ans = answer_query(agg, counts, rng)
        if dd is not None and thr_event is not None:
            assert agg.sigma1 is not None and agg.threshold is not None
            dd.add_threshold(
                int(counts.max()), agg.threshold, agg.sigma1, thr_event.noise_multiplier, thr_lattice
            )
        rho_spent += rho1
        if ans.label is not None:
            labels[asked] = ans.label
            answered += 1
            rho_spent += rho2 if not math.isnan(rho2) else 0.0
            if dd is not None:
                dd.add_gnmax(counts, agg.scale, ans_event.noise_multiplier, gn_lattice)  # type: ignore[attr-defined]
        asked += 1
        if asked % every == 0 or asked == q_max:
            curve.append((answered, asked, path_epsilon()))
    if not curve or curve[-1][1] != asked:
        curve.append((answered, asked, path_epsilon()))

    eps_dd: float | None = None
    if dd is not None and release is not None:
        if released is None or asked > asked_at_release:
            do_release()
        eps_dd = released_curve[-1][2]

    # -- the data-independent guarantee (public parameters only) ----------------------------------
    if s.budget == "data-independent":
        if agg.name == "lnmax":
            eps_di = make_accountant(s.accountant).compose(ans_event, answered).epsilon(s.delta)
        elif agg.name == "gnmax":
            eps_di = _conv(answered * ans_rdp + rel_curve, s.delta)  # answered = min(Q, n_answers)
        else:
            eps_di = _conv(_ORDERS * min(rho_max, q_max * (rho1 + rho2)) + rel_curve, s.delta)
    else:
        assert dd is not None
        max_releases = math.ceil(q_max / s.check_every) + 2
        per_query = ans_rdp + (_ORDERS * rho1 if thr_event is not None else 0.0)
        eps_di = _conv(q_max * per_query + max_releases * rel_curve, s.delta)

    if eps_dd is not None:
        # The worst-case bound also bounds the per-instance loss: never report a larger one.
        eps_dd = min(eps_dd, eps_di)
    return LabelResult(
        labels=labels[:asked],
        queries_asked=asked,
        queries_answered=answered,
        epsilon_data_independent=eps_di,
        epsilon_data_dependent=eps_dd,
        guarantee=s.budget,
        stop_reason=stop,
        released_rdp=released,
        release_order=release.order if release is not None else None,
        releases=dd.releases if dd is not None else 0,
        release_rdp_per_release=rel_lam if release is not None else None,
        answer_event=ans_event.to_dict(),
        threshold_event=thr_event.to_dict() if thr_event is not None else None,
        epsilon_curve=curve,
        released_curve=released_curve,
    )
