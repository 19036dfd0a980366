"""The public settings and the result of one PATE labelling run, and the budget plan between them.

:class:`LabelSettings` (every privacy setting, all public, checked when built), :class:`BudgetPlan`
(what the budget allows, from those settings alone) and :class:`LabelResult` (the labels and the
privacy spent) are shared by the budgeted loop (:mod:`veil.pate.labelling`) and the
Propose-Test-Release path (:mod:`veil.pate.ptr_labelling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from veil.accounting.events import Gaussian, PrivacyEvent
from veil.errors import ConfigError, InvalidParameterError
from veil.pate.aggregators import Aggregator
from veil.pate.smooth_sensitivity import ReleaseParams
from veil.pate.spending import DataIndependentBudget

__all__ = ["BudgetName", "BudgetPlan", "LabelResult", "LabelSettings", "default_release_params"]

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
