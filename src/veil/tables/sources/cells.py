"""Cells as text, one cell at a time: the rule every reader and the encoder share.

Why a rule on the cell alone: after a private row is read, how one record is encoded must not depend on
the other records. Two shortcuts broke that and are gone: a float column was written as integers
(``"3"``) only when *every* value in it was integral, so one record holding 2.5 turned another's 3.0
into ``"3.0"`` (an unknown level); and a database column holding values of two Python types (SQLite
stores a type per cell) failed Arrow's type inference for the whole read, after the run was charged.

The rule: a missing cell stays missing (NaN too); a number integral and below 2**53 in size is written
as an integer (``3.0`` → ``"3"``), any other number as Python's shortest round-trip ``repr`` (``2.5``,
``1e-07``, ``inf``) — so its text read back as a number is the same number; a boolean is ``"true"`` or
``"false"``; bytes are their hex digits (one-to-one, as for unit ids); a date or time its ISO form
(with its own UTC offset); a JSON object or array (a database's JSON, JSONB or ARRAY column) its
canonical JSON text (keys sorted); text is kept as written. A column read typed and the same column
read as text encode the same way.

A database column is typed only when its cells are booleans, integers, reals or text: Arrow infers one
type for *all* the cells of any other column, and that type leaks one record into another's text — a
JSON object gets every key any other record has (``{"a": 1}`` read as ``{'a': 1, 'b': None}``), a list
of integers becomes reals beside a list holding a real, a timestamp is shifted to the first record's
time zone. Those columns are read cell by cell as text.
"""

from __future__ import annotations

import datetime
import decimal
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["cell_text", "column_texts", "mixed_cells_as_text", "number_text", "number_texts"]

_EXACT_INTEGERS = float(2**53)


def number_text(value: float) -> str | None:
    """One number's text by the module's rule; ``None`` for NaN (missing)."""
    v = float(value)
    if v != v:
        return None
    if v.is_integer() and abs(v) < _EXACT_INTEGERS:
        return str(int(v))
    return repr(v)


def cell_text(value: object) -> str | None:
    """Any cell a database driver returns, as text by the module's rule (``None`` when missing)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float | decimal.Decimal):
        return number_text(float(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, dict | list | tuple):
        return _json_text(value)
    return str(value)


def _json_text(value: dict[object, object] | list[object] | tuple[object, ...]) -> str:
    """A JSON object or array as canonical JSON (keys sorted, no spaces); a value JSON cannot write
    (a key of mixed types, an object inside) as Python's ``repr`` — either way from the cell alone."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_cell
        )
    except (TypeError, ValueError):
        return repr(value)


def _json_cell(value: object) -> object:
    """What JSON writes for a value it has no type for: a decimal as its number (an integral one as an
    integer, as :func:`number_text` does), anything else as its :func:`cell_text`."""
    if isinstance(value, decimal.Decimal) and value.is_finite():
        return int(value) if value == value.to_integral_value() else float(value)
    return cell_text(value)


def number_texts(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A numeric Arrow column as text, each cell by :func:`number_text` (vectorised for integers)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = np.asarray(
        pc.fill_null(pc.cast(column, pa.float64()), np.nan).to_numpy(zero_copy_only=False), dtype=np.float64
    )
    integral = np.isfinite(values) & (values == np.round(values)) & (np.abs(values) < _EXACT_INTEGERS)
    texts = pc.cast(pa.array(np.where(integral, values, 0.0).astype(np.int64)), pa.string())
    other = ~integral & ~np.isnan(values)
    if other.any():
        texts = pc.replace_with_mask(
            texts, pa.array(other), pa.array([repr(float(v)) for v in values[other]], pa.string())
        )
    return pc.if_else(pa.array(np.isnan(values)), pa.scalar(None, pa.string()), texts)


def column_texts(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Any Arrow column as text by the module's rule (dictionaries decoded first)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_dictionary(kind):
        column = column.cast(kind.value_type)
        kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return column
    if pa.types.is_boolean(kind):
        return pc.if_else(column, pa.scalar("true"), pa.scalar("false"))
    if pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return pa.chunked_array([number_texts(column)], pa.string())
    if (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_temporal(kind)
    ):
        return pa.chunked_array([pa.array([cell_text(v) for v in column.to_pylist()], pa.string())])
    try:
        return pc.cast(column, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # lists, structs, maps: each cell as text
        return pa.chunked_array([pa.array([cell_text(v) for v in column.to_pylist()], pa.string())])


def _kind(value: object) -> str:
    """The group a cell's Python type reads in (``datetime`` before its base class ``date``)."""
    for kind, types in (
        ("bool", bool),
        ("int", int),
        ("float", float),
        ("str", str),
        ("bytes", (bytes, bytearray, memoryview)),
        ("datetime", datetime.datetime),
        ("date", datetime.date),
        ("time", datetime.time),
        ("decimal", decimal.Decimal),
    ):
        if isinstance(value, types):
            return kind
    return type(value).__name__


_TYPED_KINDS = frozenset({"bool", "int", "float", "str"})
"""Cell kinds Arrow types cell by cell (a cell's value, hence its text, is what it holds alone)."""


def mixed_cells_as_text(cells: Sequence[object]) -> pa.Array:
    """A column's cells as an Arrow array: typed when every non-missing cell is of one of the kinds
    :data:`_TYPED_KINDS` (integers and reals together while every integer is exact in a double), else
    every cell as text by the module's rule. Arrow's own inference is not used to decide: it reads
    ``"x"`` beside bytes as bytes, ``True`` beside 0.5 as 1.0, a date beside a datetime as a date, a
    JSON object with the keys of every other record and a timestamp in the first record's time zone —
    one record's type changing another's text."""
    import pyarrow as pa

    kinds = {_kind(v) for v in cells if v is not None}
    numbers = kinds == {"int", "float"} and all(
        abs(v) < _EXACT_INTEGERS for v in cells if isinstance(v, int) and not isinstance(v, bool)
    )
    if kinds <= _TYPED_KINDS and (len(kinds) <= 1 or numbers):
        try:
            return pa.array(list(cells))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            pass
    return pa.array([cell_text(v) for v in cells], pa.string())
