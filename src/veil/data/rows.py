"""Examples as flat rows, for any number of rows — none included.

``x.reshape(len(x), -1)`` fails on an array of 0 rows (numpy cannot infer ``-1`` from size 0), and
the number of rows a step sees after reading is often private (``veil tune``'s trial part, PATE on
the user's own files): a step that fails at 0 rows and succeeds at 1 makes a release depend on one
record. :func:`flat_rows` takes the row size from the public example shape instead, so it gives a
``(0, row size)`` array at 0 rows and behaves alike for every row count."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def flat_rows(x: np.ndarray, example_shape: Sequence[int] | None = None) -> np.ndarray:
    """``x`` as ``(len(x), row size)``; the row size is the product of ``example_shape`` (the public
    shape of one example; default ``x.shape[1:]``), never inferred from the data, so 0 rows give a
    ``(0, row size)`` array rather than an error."""
    shape = tuple(x.shape[1:]) if example_shape is None else tuple(example_shape)
    return x.reshape(len(x), math.prod(shape))
