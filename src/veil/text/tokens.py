"""Text columns: checked, then tokenized into fixed-shape integer arrays.

Every example becomes ``[2, max_length]`` integers (token ids, attention mask), padded or
truncated to ``max_length``, a length the user declares: padding to the longest text in the data
would make the array shape depend on the private data.

Two ways to check a text column. The training pipeline reads private rows, so it applies a rule to
each row alone (:func:`text_rows`): a missing or blank text drops the row (counted), any other cell
is read as text (a number as its digits) — nothing is refused on a value once a row is read.
:func:`check_texts`, for a caller's own data before anything is private, refuses instead and names
the first bad row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from veil.errors import ConfigError, DataError

__all__ = ["DEFAULT_MAX_LENGTH", "TEXT_RULES", "check_max_length", "check_texts", "text_rows", "tokenize"]

DEFAULT_MAX_LENGTH = 128


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


TEXT_RULES = ("rows_dropped_text_missing", "rows_dropped_text_empty")
"""The per-record rules' counters of :func:`text_rows`."""


def _one_column(values: Sequence[Any] | np.ndarray, column: str) -> np.ndarray:
    """``values`` as a 1-D array (the column's shape, the only thing checked as a whole)."""
    array = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
    if array.ndim != 1:
        raise DataError(
            "text_column",
            column,
            f"holds an array of shape {array.shape}, not one text per row",
            "pass one column of strings",
        )
    return array


def text_rows(values: Sequence[Any] | np.ndarray, column: str = "text") -> tuple[list[str], np.ndarray]:
    """Each row's text by a rule on that row alone: ``(texts, reason)``.

    ``reason[i]`` is 0 for a usable text, 1 (``rows_dropped_text_missing``) for a missing cell and 2
    (``rows_dropped_text_empty``) for a text of spaces only; the caller drops the rows with a reason
    (their text is ``""``). A cell that is not a string (a number, bytes) is read as text
    (:func:`veil.tables.sources.cells.cell_text`: ``3.0`` is ``"3"``). Only the column's shape (one
    value per row) is checked as a whole; no value stops the read."""
    from veil.tables.sources.cells import cell_text

    array = _one_column(values, column)
    texts: list[str] = []
    reason = np.zeros(len(array), dtype=np.int8)
    for row, value in enumerate(array.tolist()):
        text = None if _is_missing(value) else value if isinstance(value, str) else cell_text(value)
        if text is None:
            reason[row] = 1
        elif not text.strip():
            reason[row] = 2
        texts.append(text if reason[row] == 0 else "")  # type: ignore[arg-type]
    return texts, reason


def check_texts(values: Sequence[Any] | np.ndarray, column: str = "text") -> list[str]:
    """``values`` as a list of non-empty strings, or a :class:`DataError` naming the first bad row."""
    array = _one_column(values, column)
    if array.dtype.kind in "biufc":
        raise DataError(
            "text_column",
            column,
            f"holds numbers ({array.dtype}), not text; a tokenizer would read the digits as words",
            "pick the column that holds the text, or train a tabular model on numeric columns",
        )
    items = array.tolist()
    if items and all(isinstance(v, str) and _is_number(v) for v in items):
        raise DataError(
            "text_column",
            column,
            "every value is a number written as text; a tokenizer would read the digits as words",
            "pick the column that holds the text, or train a tabular model on numeric columns",
        )
    texts: list[str] = []
    for row, value in enumerate(items):
        if _is_missing(value):
            raise DataError(
                "text_column", column, f"row {row} has no value", "drop or fill the rows without text"
            )
        if not isinstance(value, str):
            raise DataError(
                "text_column",
                column,
                f"row {row} holds a {type(value).__name__}, not text",
                "pick the column that holds the text (every value a string)",
            )
        if not value.strip():
            raise DataError(
                "text_column",
                column,
                f"row {row} is empty (only spaces); the model would learn from a blank input",
                "drop or fill the rows with empty text",
            )
        texts.append(value)
    return texts


def check_max_length(tokenizer: Any, max_length: int) -> None:
    """``max_length`` fits the tokenizer's model (public settings: checked before any row is read)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(
            "max_length", max_length, "each text needs room for at least two tokens", "pass an int ≥ 2"
        )
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < max_length:
        raise ConfigError(
            "max_length",
            max_length,
            f"the model reads at most {limit} tokens; longer inputs fail inside its position embeddings",
            f"pass max_length ≤ {limit}",
        )


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """``[N, 2, max_length]`` int64: token ids and attention mask, padded/truncated to ``max_length``."""
    check_max_length(tokenizer, max_length)
    out = np.zeros((len(texts), 2, max_length), dtype=np.int64)
    chunk = 2048
    for start in range(0, len(texts), chunk):
        enc = tokenizer(
            list(texts[start : start + chunk]),
            padding="max_length",
            truncation=True,
            max_length=max_length,
            return_tensors="np",
        )
        out[start : start + chunk, 0] = enc["input_ids"]
        out[start : start + chunk, 1] = enc["attention_mask"]
    return out
