"""``veil tune``'s account with the privacy-budget registry: the whole procedure charged as one event.

The Papernot–Steinke bound is not a composition of the trials' step events (the trials' number is
random and only the best one is released), so the tuning run is charged as one
:class:`~veil.accounting.events.RepeatAndSelect` over one trial (a
:class:`~veil.accounting.events.OneOf` the search space's shapes, each its preprocessing, DP-SGD steps
and noisy score), with the trial-count law: the event :meth:`veil.tune.budget.BudgetSplit.event`
returns, whose RDP bound is the report's ε (on the registry's grid of orders). Order, as for
``veil train``: a dataset whose budget is already spent is refused before a row is read; a stand-in
(the target ε at δ) is reserved before the first row is read, and replaced by the event once the plan
is known (the sampling rates need N), before the run folder is created or a trial runs. A run that
stops in between (a refusal after reading) stays charged with the stand-in. The tuning ledger
(``ledger.jsonl``: a header and that one event) settles the charge at the end. A run killed
part-way stays charged with the whole event, which is what it may have spent.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from veil.accounting.events import PrivacyEvent
from veil.accounting.ledger import Ledger
from veil.pipeline.private_data import data_ref, open_account, stand_in_plan
from veil.pipeline.run_folder import LEDGER

__all__ = ["TuneCharge"]


class TuneCharge:
    """Open before reading, :meth:`reserve` before the folder exists, :meth:`start`, then :meth:`settle`."""

    def __init__(self, dataset: str, settings: dict[str, Any]) -> None:
        self.account = open_account(data_ref(dataset, settings), job="tune")
        self.run_id = uuid.uuid4().hex
        self.event: PrivacyEvent | None = None
        self.ledger: Ledger | None = None

    def reserve_before_reading(self, epsilon: float, delta: float) -> None:
        """The stand-in (:func:`~veil.pipeline.private_data.stand_in_plan`: the target ε at δ) against
        the dataset's budget, before a row is read (refused: nothing recorded); from here the run
        stays charged, whatever happens."""
        try:
            self.account.reserve(stand_in_plan(epsilon, delta), self.run_id, delta)
        except BaseException:
            self.account.close()
            raise
        self.account.reading()

    def reserve(self, event: PrivacyEvent, delta: float) -> None:
        """The whole procedure's event in place of the stand-in, before any trial or file (refused:
        the stand-in stays charged, see :meth:`abandon`)."""
        self.account.replan([event], delta)
        self.event = event

    def abandon(self) -> None:
        """End a run stopped before its folder exists: settled at what it reserved, never released."""
        self.account.finish(None)

    def start(self, out: Path) -> None:
        """Create the run folder and its tuning ledger, holding the charged event."""
        assert self.event is not None, "reserve before start"
        out.mkdir(parents=True, exist_ok=True)
        header = {"job": "tune", "budget_run_id": self.run_id, "budget_dataset_id": self.account.dataset_id}
        self.ledger = Ledger.create(out / LEDGER, header)
        self.ledger.append("event", label="tuning (random stopping)", event=self.event.to_dict())

    def settle(self) -> None:
        """Charge what the ledger holds (the reserved event) and close the account."""
        events = None
        if self.ledger is not None:
            self.ledger.close()
            events = self.ledger.events()
        self.account.finish(events)
