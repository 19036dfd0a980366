"""PATE: private labels from an ensemble of teachers trained on disjoint partitions.

Modules: :mod:`~veil.pate.config` (the settings), :mod:`~veil.pate.data` (private part, public
pool, test set), :mod:`~veil.pate.partition` (disjoint teacher sets), :mod:`~veil.pate.teachers`
(training, parallel and resumable), :mod:`~veil.pate.aggregators` (LNMax, GNMax, Confident-GNMax),
:mod:`~veil.pate.spending` (the events spent and the data-independent budget rules),
:mod:`~veil.pate.analysis` (data-independent and data-dependent RDP),
:mod:`~veil.pate.smooth_sensitivity` (private release of the data-dependent ε),
:mod:`~veil.pate.labelling` (the budgeted labelling loop), :mod:`~veil.pate.ptr`
(Propose-Test-Release: the data-dependent analysis as a guarantee), :mod:`~veil.pate.student`
(optionally semi-supervised), :mod:`~veil.pate.run` (end to end, ``veil pate``). Guarantees and
their exact meaning: ``docs/pate.md``. Importing this package does not import torch or scipy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Aggregator": "veil.pate.aggregators",
    "ConfidentGNMax": "veil.pate.aggregators",
    "GNMax": "veil.pate.aggregators",
    "LNMax": "veil.pate.aggregators",
    "make_aggregator": "veil.pate.aggregators",
    "answer_query": "veil.pate.aggregators",
    "partition_teachers": "veil.pate.partition",
    "check_public_shape": "veil.pate.partition",
    "count_shared_rows": "veil.pate.partition",
    "train_teachers": "veil.pate.teachers",
    "ModelRecipe": "veil.pate.teachers",
    "LabelSettings": "veil.pate.labelling",
    "label_queries": "veil.pate.labelling",
    "ReleaseParams": "veil.pate.smooth_sensitivity",
    "PtrPlan": "veil.pate.ptr",
    "plan_ptr": "veil.pate.ptr",
    "train_student": "veil.pate.student",
    "PateConfig": "veil.pate.config",
    "make_pate_config": "veil.pate.config",
    "resolve_pate_config": "veil.pate.config",
    "run_pate": "veil.pate.run",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'veil.pate' has no attribute {name!r}")
