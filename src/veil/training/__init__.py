"""The train job (``veil train``, :func:`veil.train`): one DP training run end to end, a
:class:`~veil.report.Report` back. A package like the other jobs (tune, pate, synth, federated,
audit); named apart from the function so that ``veil.train`` stays the function.

* :mod:`veil.training.run` — the entry points (:func:`train`, resume), the budget account opened
  before a row is read, the guarantee (its docstring);
* :mod:`veil.training.prepare` — everything checked before anything is written, the ledger header;
* :mod:`veil.training.execute` — the accounted loop to the step the budget allows, evaluation,
  baseline;
* :mod:`veil.training.report` — the report: figures, what the guarantee covers, ``non_private``;
* :mod:`veil.training.outputs` — the model, plots and pages written, ``release/``, the folder sealed;
* :mod:`veil.training.rank` — one rank of a multi-process run (started by
  :mod:`veil.distributed.job`'s launcher or by torchrun).
"""

from __future__ import annotations

from veil.report import Report
from veil.training.run import train

__all__ = ["Report", "train"]
