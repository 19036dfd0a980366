"""A PATE run's charge to the privacy-budget registry (``veil budget``).

One :class:`~veil.accounting.events.ApproximateDP` event at the run's δ: PATE's guarantee is an
(ε, δ) statement (PTR, data-dependent stopping), not a composition of events. Reserved before a
private row is read when the plan's shape is public (``--public-data`` and ``--classes``:
:func:`plan_shape`), else (a built-in benchmark, whose public split sets the pool) once the data is
loaded; always before any teacher is trained: the most ε the budget allows
(:func:`veil.pate.labelling.planned_epsilon`). Settled to the released labels' guarantee; a run that
stops before releasing a label stays charged with its plan
(:class:`veil.pipeline.private_data.PrivateAccount`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.pate.config import PateConfig
from veil.pate.data import load_public_data

if TYPE_CHECKING:
    from veil.pate.label_settings import LabelResult, LabelSettings

__all__ = ["PateAccount", "plan_shape"]


def plan_shape(cfg: PateConfig) -> tuple[int, int] | None:
    """(queries, classes) of the plan from public facts alone — the declared public pool's size and the
    declared label set — or ``None`` when they come with the data (a built-in benchmark)."""
    if cfg.public_data is None or cfg.classes is None:
        return None
    pool = len(load_public_data(cfg.public_data)[0])
    return min(cfg.queries or pool, pool), len(cfg.classes)


class PateAccount:
    """The run's charge to the privacy-budget registry (``veil budget``), as one
    :class:`~veil.accounting.events.ApproximateDP` event at the run's δ: PATE's guarantee is an (ε, δ)
    statement (PTR, data-dependent stopping), not a composition of events. Reserved before a private row
    is read when the plan's shape is public (``--public-data`` and ``--classes``: :func:`plan_shape`),
    else (a built-in benchmark, whose public split sets the pool) once the data is loaded; always before
    any teacher is trained: the most ε the budget allows (:func:`veil.pate.labelling.planned_epsilon`).
    Settled to the released labels' guarantee; a run that stops before releasing a label stays charged
    with its plan (:class:`veil.pipeline.private_data.PrivateAccount`)."""

    def __init__(self, cfg: PateConfig, charge: Any) -> None:
        self.cfg = cfg
        self.charge = charge
        self.released: LabelResult | None = None

    @classmethod
    def before_reading(cls, cfg: PateConfig) -> PateAccount:
        from veil.pipeline.private_data import data_ref, open_account

        return cls(cfg, open_account(data_ref(cfg.dataset, cfg), job="pate"))

    def reserve(self, settings: LabelSettings) -> None:
        """Reserve the plan; from here the private rows are (being) read, so the charge stands."""
        import uuid

        from veil.accounting.events import ApproximateDP
        from veil.pate.labelling import plan_budget, planned_epsilon

        planned = planned_epsilon(settings, plan_budget(settings, True, settings.max_queries))
        self.charge.reserve([ApproximateDP(planned, self.cfg.delta)], uuid.uuid4().hex, self.cfg.delta)
        self.charge.reading()

    def budget_section(self, out: Path) -> dict[str, Any] | None:
        """The report's ``dataset_budget``: this run counted with what it released."""
        from veil.accounting.events import ApproximateDP

        released = self.released
        events = None if released is None else [ApproximateDP(released.epsilon, self.cfg.delta)]
        return self.charge.budget_section(events, out) if self.charge.run_id is not None else None

    def settle(self) -> None:
        from veil.accounting.events import ApproximateDP

        released = self.released
        self.charge.finish(None if released is None else [ApproximateDP(released.epsilon, self.cfg.delta)])
