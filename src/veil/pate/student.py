"""The student: trained on public examples with the labels the aggregator released.

Privacy: the student sees only public inputs and the privately released labels, so whatever it
does with them is post-processing of the aggregation's output and costs no privacy. That includes
the optional semi-supervised step: self-training on the *unlabelled* rest of the public pool uses
public inputs and the student's own predictions, never the pool's true labels (the pool's labels
are not even passed in) and never the private data or the teachers.

Semi-supervised step (``semi_supervised=True``): class-balanced self-training (pseudo-labelling;
Yarowsky 1995, Lee 2013; class-balanced selection as in Zou et al. 2018). After fitting on the
answered queries, for ``rounds`` rounds: predict class probabilities on the unlabelled pool, keep
for each predicted class its most confident examples up to a per-class quota that grows with the
round (round r of R keeps at most ``r/R · pseudo_fraction · |pool| / C`` per class), and refit
from scratch on the labelled examples plus these pseudo-labelled ones, the labelled ones repeated
so that both parts weigh the same (``balance``; Lee 2013's objective with α = 1). Per-class quotas stop one
dominant class from absorbing the pool; refitting from scratch each round (rather than
accumulating) lets early mistakes drop out. The model must expose ``predict_proba(x)`` returning
one column per class ``0..C−1`` (the built-in models do); otherwise the step is skipped and the
result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from veil.errors import DataError, InvalidParameterError
from veil.pate.teachers import Estimator, Factory, predict_labels

__all__ = ["StudentResult", "train_student"]


@dataclass
class StudentResult:
    """The trained student and its accuracy on the held-out test set."""

    model: Estimator
    test_accuracy: float
    train_size: int
    """Examples with a released label."""
    pseudo_labelled: int = 0
    """Unlabelled public examples added with the student's own labels in the last round."""
    semi_supervised: bool = False
    """Whether the self-training step ran (it needs ``predict_proba``)."""


def _select(proba: np.ndarray, quota: int) -> np.ndarray:
    """Indices of the most confident predictions, at most ``quota`` per predicted class."""
    pred = proba.argmax(axis=1)
    conf = proba.max(axis=1)
    keep: list[np.ndarray] = []
    for c in np.unique(pred):
        idx = np.flatnonzero(pred == c)
        keep.append(idx[np.argsort(-conf[idx], kind="stable")[:quota]])
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def train_student(
    x_public: np.ndarray,
    labels: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    factory: Factory,
    *,
    x_unlabelled: np.ndarray | None = None,
    semi_supervised: bool = False,
    rounds: int = 2,
    pseudo_fraction: float = 0.8,
    balance: bool = True,
) -> StudentResult:
    """Fit ``factory(0)`` on the answered public examples (and, if ``semi_supervised``, self-train on
    ``x_unlabelled``); score it on the test set."""
    if len(labels) == 0:
        raise DataError(
            "queries_answered",
            0,
            "no query was answered, so the student has nothing to learn from",
            "raise ε, ask more queries, or lower the Confident-GNMax threshold",
        )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise InvalidParameterError("student_rounds", rounds, "self-training rounds", "pass an integer ≥ 1")
    if not (0 < pseudo_fraction <= 1):
        raise InvalidParameterError(
            "pseudo_fraction", pseudo_fraction, "a share of the unlabelled pool", "pass a number in (0, 1]"
        )
    x_l = np.asarray(x_public)
    y_l = np.asarray(labels, dtype=np.int64)
    model = factory(0)
    model.fit(x_l, y_l)
    pseudo = 0
    ran = False
    pool = np.asarray(x_unlabelled) if x_unlabelled is not None else None
    if semi_supervised and pool is not None and len(pool) and hasattr(model, "predict_proba"):
        ran = True
        num_classes = max(int(y_l.max()) + 1, 2)
        for r in range(1, rounds + 1):
            proba = np.asarray(model.predict_proba(pool))
            quota = max(1, int(r / rounds * pseudo_fraction * len(pool) / num_classes))
            pick = _select(proba, quota)
            # Balanced objective (Lee 2013 with α = 1): the released labels, repeated, weigh as much
            # in total as the pseudo-labels, so they are not drowned by the student's own guesses.
            rep = max(1, round(pick.size / len(y_l))) if balance else 1
            x_r = np.concatenate([np.repeat(x_l, rep, axis=0), pool[pick]])
            y_r = np.concatenate([np.repeat(y_l, rep), proba[pick].argmax(axis=1).astype(np.int64)])
            model = factory(0)
            model.fit(x_r, y_r)
            pseudo = int(pick.size)
    pred = predict_labels(model, np.asarray(x_test))
    acc = float(np.mean(pred == np.asarray(y_test))) if len(y_test) else math.nan
    return StudentResult(
        model=model, test_accuracy=acc, train_size=len(labels), pseudo_labelled=pseudo, semi_supervised=ran
    )
