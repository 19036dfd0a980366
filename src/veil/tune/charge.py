"""``veil tune``'s account with the privacy-budget registry: the whole procedure charged as one event.

The Papernot–Steinke bound is not a composition of the trials' step events (the trials' number is
random and only the best one is released), so the tuning run is charged as one
:class:`~veil.accounting.events.RepeatAndSelect` over one trial (a
:class:`~veil.accounting.events.OneOf` the search space's shapes, each its preprocessing, DP-SGD steps
and noisy score), with the trial-count law: the event :meth:`veil.tune.budget.BudgetSplit.event`
returns, whose RDP bound is the report's ε (on the registry's grid of orders). Order, as for
``veil train``: a dataset whose budget is already spent is refused before a row is read; the event
is reserved once the plan is known (the sampling rates need N) and before the run folder is created
or a trial runs; the tuning ledger (``ledger.jsonl``: a header and that one event) settles the charge
at the end. A run killed part-way stays charged with the whole event, which is what it may have
spent.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from veil.accounting.events import PrivacyEvent
from veil.accounting.ledger import Ledger
from veil.pipeline.run_folder import LEDGER
from veil.registry.charge import DatasetCharge

__all__ = ["TuneCharge"]


class TuneCharge:
    """Open before reading, :meth:`reserve` before the folder exists, :meth:`start`, then :meth:`settle`."""

    def __init__(self, dataset: str, settings: dict[str, Any]) -> None:
        self.charge = DatasetCharge.before_reading(
            dataset,
            job="tune",
            data_dir=settings.get("data_dir"),
            table=settings.get("table"),
            query=settings.get("query"),
            dataset_id=settings.get("dataset_id"),
            privacy_unit=settings.get("privacy_unit"),
        )
        self.run_id = uuid.uuid4().hex
        self.event: PrivacyEvent | None = None
        self.ledger: Ledger | None = None

    def reserve(self, event: PrivacyEvent, delta: float) -> None:
        """The whole procedure's event against the dataset's budget (refused: nothing recorded)."""
        try:
            self.charge.reserve([event], self.run_id, delta)
        except BaseException:
            self.charge.close()
            raise
        self.event = event

    def start(self, out: Path) -> None:
        """Create the run folder and its tuning ledger, holding the charged event."""
        assert self.event is not None, "reserve before start"
        out.mkdir(parents=True, exist_ok=True)
        header = {"job": "tune", "budget_run_id": self.run_id, "budget_dataset_id": self.charge.identity.id}
        self.ledger = Ledger.create(out / LEDGER, header)
        self.ledger.append("event", label="tuning (random stopping)", event=self.event.to_dict())

    def settle(self) -> None:
        """Charge what the ledger holds (the reserved event) and close the account."""
        try:
            if self.ledger is not None:
                self.ledger.close()
                self.charge.settle(self.ledger.events())
        finally:
            self.charge.close()
