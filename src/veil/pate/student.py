"""The student: trained on public examples with the labels the aggregator released.

The student sees only public inputs and privately released labels, so it is covered by the
aggregation's guarantee by post-processing. It is supervised on the answered queries; the rest of
the public pool is not used (no semi-supervised step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from veil.errors import DataError
from veil.pate.teachers import Estimator, Factory

__all__ = ["StudentResult", "train_student"]


@dataclass
class StudentResult:
    """The trained student and its accuracy on the held-out test set."""

    model: Estimator
    test_accuracy: float
    train_size: int


def train_student(
    x_public: np.ndarray,
    labels: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    factory: Factory,
) -> StudentResult:
    """Fit ``factory(0)`` on the answered public examples and score it on the test set."""
    if len(labels) == 0:
        raise DataError(
            "queries_answered",
            0,
            "no query was answered, so the student has nothing to learn from",
            "raise ε, ask more queries, or lower the Confident-GNMax threshold",
        )
    model = factory(0)
    model.fit(np.asarray(x_public), np.asarray(labels, dtype=np.int64))
    pred = np.asarray(model.predict(np.asarray(x_test)))
    acc = float(np.mean(pred == np.asarray(y_test))) if len(y_test) else math.nan
    return StudentResult(model=model, test_accuracy=acc, train_size=len(labels))
