"""Private hyperparameter tuning (``veil tune``): a random number of full DP training runs, the best
chosen by a DP validation score, the whole procedure accounted (Papernot & Steinke, ICLR 2022).

Modules: :mod:`veil.tune.space` (the search space and the secure draws), :mod:`veil.tune.budget`
(each trial's σ so the whole procedure meets the target), :mod:`veil.tune.trial` (one trial through
the train job's pipeline, its DP score), :mod:`veil.tune.run` (the job), :mod:`veil.tune.report`
(report.json and the page). The accounting itself lives in :mod:`veil.accounting.tuning`.
"""

from __future__ import annotations

__all__ = ["tune"]


def tune(*args, **kwargs):  # type: ignore[no-untyped-def]
    """See :func:`veil.tune.run.tune` (imported lazily: ``import veil.tune`` stays free of torch)."""
    from veil.tune.run import tune as _tune

    return _tune(*args, **kwargs)
