"""The table encoder: columns → a float32 feature matrix, fixed entirely by the schema.

Guarantee (data independence). The encoding of a row depends only on that row and the schema: the
output width, the position of every feature and the value written there are functions of the
declared levels, bounds and policies, never of other rows. So encoding is a public, per-record
transformation: it costs no privacy, and a model trained on encoded rows is protected exactly as if
it were trained on the rows themselves (one record in, one encoded record out; neighbouring tables
stay neighbouring). Nothing is imputed from other rows.

Per-record public rules (no data-dependent halt once rows are read; see ``docs/tables.md``): a row
whose label is outside the declared classes, or missing, is dropped (a function of that row alone, so
neighbours stay neighbours); a cell of a numeric column that is not a number is missing; a row with a
value that a ``"drop"`` policy of the schema covers (``outside``, ``unknown``, ``missing``; ``"error"``
is the old name) is dropped. How many rows and cells each rule touched is counted
(:attr:`EncodedTable.rules`, reported as non-private; a row breaking several rules counts under each),
and which source rows were dropped is marked (:attr:`EncodedTable.dropped`), so a caller holding
per-row data beside the features (privacy-unit ids, row numbers) filters it in the same step. No rule
raises, and no message carries a cell's value.

Per column type (``x`` the output block, in schema order):

* numeric — ``clip(v, lo, hi)`` mapped linearly onto ``[-1, 1]``; ``outside = "drop"`` drops the
  row of a value outside ``[lo, hi]`` instead. A missing value (null or NaN) becomes ``0`` plus a 1 in
  the column's ``:missing`` indicator (``missing = "indicator"``), or its row is dropped (``"drop"``).
* categorical (one-hot) — one 0/1 feature per declared level, then ``:unknown`` (a value not among
  the levels, when ``unknown = "level"``) and ``:missing``.
* categorical (embedding) — one feature holding the level's code ``0..L-1``, ``L`` for unknown,
  ``L+1`` for missing (as a float; the model's embedding layer reads it). For wide categoricals.
* ordinal — the level's rank mapped onto ``[-1, 1]`` (0 if unknown or missing), plus ``:unknown``
  and ``:missing`` indicators as declared.
* boolean — ``+1`` true, ``-1`` false, ``0`` otherwise, plus indicators as declared; spellings
  ``true/false, t/f, yes/no, y/n, 1/0`` (any case).
* text and ignored columns are not encoded; the target becomes class indices in the order of the
  declared classes, and a row whose label is outside them (or missing) is dropped.

The encoder is a plain JSON document (:meth:`TableEncoder.to_dict`), saved beside ``model.pt`` so that
predictions on new rows use the same mapping.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.errors import DataError
from veil.tables.schema import BOOLEAN_FALSE, BOOLEAN_TRUE, ColumnSpec, TableSchema, parse_schema
from veil.tables.sources.cells import column_texts

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.sources import RawTable

__all__ = ["EncodedTable", "TableEncoder"]

ENCODER_FORMAT = "veil-table-encoder/1"
_SLICE = 1 << 18


@dataclass
class EncodedTable:
    """Encoded features (float32, N×d), class indices (or ``None`` without a target column)."""

    x: np.ndarray
    y: np.ndarray | None
    feature_names: list[str]
    classes: list[str]
    rules: dict[str, int] = field(default_factory=dict)
    """How many rows or cells each per-record rule touched (non-private counts)."""

    units: list[object] | None = None
    """Each row's privacy-unit id (text, ``None`` when missing), when a unit column was read; an
    identifier, never a feature (:mod:`veil.tables.units`)."""

    dropped: np.ndarray | None = None
    """One flag per source row read: whether a per-record rule dropped it (label or feature). With
    ``drop=True`` those rows are not in ``x``; with ``drop=False`` they are, with label -1."""


DROP_RULES = ("rows_dropped_outside", "rows_dropped_unknown", "rows_dropped_missing")
"""The schema's ``"drop"`` policies' counters: a feature value outside its bounds, not among its
levels, or missing, in a column whose policy drops the row."""

RULES = (
    "rows_dropped_malformed",
    "rows_dropped_label_not_declared",
    "rows_dropped_label_missing",
    "cells_not_a_number_made_missing",
    *DROP_RULES,
)
"""The per-record rules' counters, in :attr:`EncodedTable.rules`."""


class TableEncoder:
    """Encodes tables with the layout fixed by a reviewed (or DP-released) schema."""

    def __init__(self, schema: TableSchema) -> None:
        self.schema = schema
        self.feature_names: list[str] = []
        self.embeddings: list[tuple[int, int]] = []
        """(feature position, number of codes) of every embedding-encoded column."""
        for c in schema.features:
            start = len(self.feature_names)
            self.feature_names += _block_names(c)
            if c.type == "categorical" and c.encoding == "embedding":
                self.embeddings.append((start, len(c.levels) + 2))

    @property
    def width(self) -> int:
        return len(self.feature_names)

    @property
    def classes(self) -> list[str]:
        t = self.schema.target
        return list(t.levels) if t is not None else []

    # -- serialisation ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        from veil.tables.schema import _loads, schema_to_toml

        return {
            "format": ENCODER_FORMAT,
            "schema": _loads(schema_to_toml(self.schema)),
            "feature_names": self.feature_names,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableEncoder:
        if not isinstance(data, dict) or data.get("format") != ENCODER_FORMAT:
            raise DataError(
                "encoder",
                data.get("format") if isinstance(data, dict) else type(data).__name__,
                "this is not a veil table encoder, so new rows cannot be encoded as in training",
                "use the encoder.json written beside model.pt by veil train",
            )
        enc = cls(parse_schema(data["schema"], "encoder"))
        if enc.feature_names != data.get("feature_names"):
            raise DataError(
                "encoder",
                "feature layout",
                "the saved layout differs from the one its schema gives",
                "re-train, or restore the encoder.json written with the model",
            )
        return enc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n"

    def save(self, path: str | Path) -> None:
        from veil.accounting.ledger import atomic_write_text

        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> TableEncoder:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(
                "encoder", str(path), f"it cannot be read ({exc.__class__.__name__})", "check the run folder"
            ) from None
        return cls.from_dict(data)

    # -- encoding ---------------------------------------------------------------------------------

    def encode(self, raw: RawTable, *, with_target: bool = True, drop: bool = True) -> EncodedTable:
        """Encode every row. ``drop=False`` keeps the rows a rule drops, with label -1 and flagged in
        ``dropped`` (a caller that maps encoded rows back to the source's positions filters them)."""
        return self.encode_batches(
            raw.table.num_rows, iter([raw]), with_target=with_target, where=raw.source.describe(), drop=drop
        )

    def encode_batches(
        self,
        rows: int | None,
        batches: Iterator[RawTable],
        *,
        with_target: bool = True,
        where: str = "table",
        drop: bool = True,
    ) -> EncodedTable:
        """Encode a table given in batches into one float32 matrix, rows a rule drops left out (kept,
        with label -1, when ``drop=False``); :attr:`EncodedTable.dropped` flags them either way.

        With ``rows`` (an upper bound on the row count) the result is allocated once, zero pages
        untouched until written, so the peak is the result plus one batch; without it the encoded
        batches are concatenated at the end.

        Guarantee: ``rows`` is a hint for memory, never a condition. Should more rows arrive than it
        allows (a bound that is wrong), the rows encoded so far become the first block and the rest
        is concatenated: the result is the one without a bound. How many rows the private file
        holds never makes a job fail after reading, nor appears in a message.
        """
        x = np.zeros((rows, self.width), dtype=np.float32) if rows is not None else None
        y = np.zeros(rows, dtype=np.int64) if rows is not None and with_target else None
        blocks: list[tuple[np.ndarray, np.ndarray | None]] = []
        n = 0
        target = self.schema.require_target("training") if with_target else None
        rules = dict.fromkeys(RULES, 0)
        flags: list[np.ndarray] = []
        for raw in batches:
            rules["rows_dropped_malformed"] += raw.malformed
            m = raw.table.num_rows
            if x is not None and n + m > x.shape[0]:  # a bound passed: concatenate from here on
                blocks.append((x[:n], y[:n] if y is not None else None))
                x = y = None
            xb = x[n : n + m] if x is not None else np.zeros((m, self.width), dtype=np.float32)
            dropped = self._encode_into(raw, xb, rules)
            yb = _encode_target(target, raw.table.column(target.name), self.schema, rules) if target else None
            if yb is not None:
                yb[dropped] = -1  # one mark for every rule: the label's and the features'
                dropped |= yb < 0
            flags.append(dropped)
            if drop and dropped.any():  # the dropped rows leave no gap
                keep = ~dropped
                xb[: int(keep.sum())] = xb[keep]
                xb = xb[: int(keep.sum())]
                yb = yb[keep] if yb is not None else None
            k = len(xb)
            if y is not None and yb is not None:
                y[n : n + k] = yb
            if x is None:
                blocks.append((xb, yb))
            n += k
        # n = 0 (an empty table, or every row dropped by a rule) is no refusal: whether it happens
        # depends on one record, and a job whose N is private (synth) releases on zero rows; a job
        # whose N is public refuses N = 0 itself (veil.pipeline.data.check_delta)
        if x is None:
            x = np.concatenate([b[0] for b in blocks]) if blocks else np.zeros((0, self.width), np.float32)
            y = (
                np.concatenate([b[1] for b in blocks if b[1] is not None] or [np.zeros(0, np.int64)])
                if target
                else None
            )
        else:
            x, y = x[:n], (y[:n] if y is not None else None)
        return EncodedTable(
            x=x,
            y=y,
            feature_names=list(self.feature_names),
            classes=self.classes,
            rules=rules,
            dropped=np.concatenate(flags) if flags else np.zeros(0, dtype=bool),
        )

    def _encode_into(self, raw: RawTable, x: np.ndarray, rules: dict[str, int]) -> np.ndarray:
        """Encode one batch into ``x``; returns the rows a feature's ``"drop"`` policy drops (counted)."""
        drops = {rule: np.zeros(raw.table.num_rows, dtype=bool) for rule in DROP_RULES}
        pos = 0
        for c in self.schema.features:
            width = len(_block_names(c))
            out = x[:, pos : pos + width]
            _encode_column(c, raw.table.column(c.name), out, raw, self.schema, rules, drops)
            pos += width
        for rule, rows in drops.items():
            rules[rule] += int(rows.sum())
        return np.logical_or.reduce(list(drops.values()))


# -- per column ---------------------------------------------------------------------------------


def _block_names(c: ColumnSpec) -> list[str]:
    names: list[str] = []
    if c.type == "numeric" or c.type == "ordinal" or c.type == "boolean":
        names.append(c.name)
    elif c.type == "categorical":
        names += [c.name] if c.encoding == "embedding" else [f"{c.name}={lv}" for lv in c.levels]
    if (
        c.type != "numeric"
        and c.unknown == "level"
        and not (c.type == "categorical" and c.encoding == "embedding")
    ):
        names.append(f"{c.name}:unknown")
    if c.missing == "indicator" and not (c.type == "categorical" and c.encoding == "embedding"):
        names.append(f"{c.name}:missing")
    return names


def _numbers(
    c: ColumnSpec, column: pa.ChunkedArray, raw: RawTable, missing: list[str], rules: dict[str, int]
) -> np.ndarray:
    """float64 values with NaN for missing; a cell that is not a number is missing too (counted).

    A column stored as another type than numbers (all missing, dates, mixed) is read cell by cell as
    text (:mod:`~veil.tables.sources.cells`), never refused: after a private row is read, how a
    record reads cannot depend on what the others hold."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_dictionary(kind):
        column = column.cast(kind.value_type)
        kind = column.type
    if pa.types.is_decimal(kind):
        column = pc.cast(column, pa.float64())
    elif not (pa.types.is_boolean(kind) or pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        trimmed = pc.utf8_trim_whitespace(column_texts(column))
        is_missing = pc.fill_null(pc.is_in(trimmed, pa.array(missing, pa.string())), False)
        trimmed = pc.if_else(is_missing, pa.scalar(None, pa.string()), trimmed)
        try:
            column = pc.cast(trimmed, pa.float64())
        except pa.ArrowInvalid:
            values = [_number_or_none(v) for v in trimmed.to_pylist()]
            rules["cells_not_a_number_made_missing"] += sum(
                v is None and t is not None for v, t in zip(values, trimmed.to_pylist(), strict=True)
            )
            column = pa.chunked_array([pa.array(values, pa.float64())])
    return (
        np.asarray(column.to_numpy(), dtype=np.float64)
        if column.null_count == 0
        else np.asarray(pc.fill_null(pc.cast(column, pa.float64()), np.nan).to_numpy(), dtype=np.float64)
    )


def _number_or_none(text: str | None) -> float | None:
    """The cell as a number, or ``None`` (missing) when it is not one; ``"true"``/``"false"`` (a
    boolean cell's text, :mod:`~veil.tables.sources.cells`) are 1 and 0, as a boolean column reads."""
    if text is None:
        return None
    if text in ("true", "false"):
        return 1.0 if text == "true" else 0.0
    try:
        return float(text)
    except ValueError:
        return None


def _strings(column: pa.ChunkedArray, missing: list[str]) -> tuple[pa.ChunkedArray, np.ndarray]:
    """Values as trimmed text, each cell by :mod:`~veil.tables.sources.cells`' rule (a number integral
    below 2**53 as an integer, whatever the other cells hold), and the missing mask."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = pc.utf8_trim_whitespace(column_texts(column))
    null = pc.is_null(column)
    if missing:
        null = pc.or_(null, pc.fill_null(pc.is_in(column, pa.array(missing)), False))
    return column, np.asarray(null.to_numpy(zero_copy_only=False), dtype=bool)


def _codes(column: pa.ChunkedArray, levels: tuple[str, ...]) -> np.ndarray:
    """Index of each value among ``levels``; -1 for any other value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    idx = pc.index_in(column, value_set=pa.array(list(levels), pa.string()))
    return np.asarray(pc.fill_null(idx, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _encode_column(
    c: ColumnSpec,
    column: pa.ChunkedArray,
    out: np.ndarray,
    raw: RawTable,
    schema: TableSchema,
    rules: dict[str, int],
    drops: dict[str, np.ndarray],
) -> None:
    """Encode one column into ``out``; a row its ``"drop"`` policies drop is flagged in ``drops``."""
    missing_tokens = [v.strip() for v in schema.missing_values]
    if c.type == "numeric":
        _encode_numeric(c, _numbers(c, column, raw, missing_tokens, rules), out, drops)
        return
    text, miss = _strings(column, missing_tokens)
    if c.type == "boolean":
        codes = _codes(_lower(text), BOOLEAN_FALSE + BOOLEAN_TRUE)
        value = np.where(codes < 0, 0.0, np.where(codes >= len(BOOLEAN_FALSE), 1.0, -1.0))
    else:
        codes = _codes(text, c.levels)
        value = np.zeros(len(codes))
    unknown = (codes < 0) & ~miss
    if c.unknown == "drop":
        drops["rows_dropped_unknown"] |= unknown
    if c.missing == "drop":
        drops["rows_dropped_missing"] |= miss
    if c.type == "boolean":
        out[:, 0] = np.where(miss, 0.0, value)
        col = 1
    elif c.type == "ordinal":
        rank = codes.astype(np.float64)
        span = max(len(c.levels) - 1, 1)
        out[:, 0] = np.where(codes >= 0, rank * (2.0 / span) - (1.0 if len(c.levels) > 1 else 0.0), 0.0)
        col = 1
    elif c.encoding == "embedding":
        L = len(c.levels)
        out[:, 0] = np.where(miss, L + 1, np.where(codes >= 0, codes, L))
        return
    else:
        known = codes >= 0
        rows = np.flatnonzero(known)
        out[rows, codes[rows]] = 1.0
        col = len(c.levels)
    if c.unknown == "level":
        out[:, col] = unknown
        col += 1
    if c.missing == "indicator":
        out[:, col] = miss


def _encode_numeric(c: ColumnSpec, v: np.ndarray, out: np.ndarray, drops: dict[str, np.ndarray]) -> None:
    """Clip to the bounds and map onto [-1, 1], in slices so that float64 temporaries stay small; flag
    the rows the ``"drop"`` policies drop (a value outside the bounds, a missing value)."""
    assert c.bounds is not None
    lo, hi = c.bounds
    mid, scale = (lo + hi) / 2, 2 / (hi - lo)
    for start in range(0, len(v), _SLICE):
        part = v[start : start + _SLICE].astype(np.float64)
        miss = np.isnan(part)
        here = slice(start, start + len(part))
        if c.outside == "drop":
            drops["rows_dropped_outside"][here] |= ~miss & ((part < lo) | (part > hi))
        if c.missing == "drop":
            drops["rows_dropped_missing"][here] |= miss
        np.clip(part, lo, hi, out=part)
        part -= mid
        part *= scale
        part[miss] = 0.0
        out[here, 0] = part
        if c.missing == "indicator":
            out[here, 1] = miss


def _lower(text: pa.ChunkedArray) -> pa.ChunkedArray:
    import pyarrow.compute as pc

    return pc.utf8_lower(text)


def _encode_target(
    c: ColumnSpec, column: pa.ChunkedArray, schema: TableSchema, rules: dict[str, int]
) -> np.ndarray:
    """Class indices in the declared order; -1 for a row the rules drop (label missing, or outside the
    declared classes), each counted."""
    text, miss = _strings(column, [v.strip() for v in schema.missing_values])
    codes = _codes(text, c.levels)
    codes[miss] = -1
    rules["rows_dropped_label_missing"] += int(miss.sum())
    rules["rows_dropped_label_not_declared"] += int(((codes < 0) & ~miss).sum())
    return codes
