"""The synthesizer's discrete domain, fixed by the schema alone, and the row ⇄ code mappings.

Every used column becomes one discrete attribute whose cells are public (nothing is read from the
rows):

* categorical / ordinal — the declared levels, then an ``unknown`` cell (``unknown = "level"``) and
  a ``missing`` cell (``missing = "indicator"``; under a ``"drop"`` policy the encoder drops such a row,
  so the cell is not needed);
* boolean — ``false``, ``true`` and the same two optional cells;
* numeric — ``bins`` equal-width bins over the declared public bounds (values outside are clipped,
  or their row dropped, by the schema's encoder), and a ``missing`` cell;
* the target — its declared classes.

Rows are mapped to codes through :class:`veil.tables.encoder.TableEncoder` (a public, per-record
transformation), so one record changes one row of codes: neighbouring tables stay neighbouring.
Synthetic codes are written back as values: a level's text, a numeric value drawn uniformly inside
its bin (post-processing with public bounds), an empty cell for ``missing`` and
:data:`UNKNOWN_TEXT` for ``unknown``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from veil.errors import ConfigError
from veil.tables.schema import ColumnSpec, TableSchema

__all__ = ["UNKNOWN_TEXT", "Attribute", "Domain", "codes_from_features", "domain_from_schema"]

UNKNOWN_TEXT = "<unknown>"
MISSING = "<missing>"


@dataclass(frozen=True)
class Attribute:
    """One column as a discrete attribute: its cells' labels (for reports) and how to write them."""

    name: str
    kind: str
    """The schema type ("numeric", "categorical", "ordinal", "boolean") or "target"."""
    labels: tuple[str, ...]
    bounds: tuple[float, float] | None = None
    bins: int = 0

    @property
    def size(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Domain:
    """The attributes, in schema order."""

    attributes: tuple[Attribute, ...]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.attributes]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.attributes)

    @property
    def cells(self) -> int:
        """The size of the full joint domain (a Python int; it may be astronomically large)."""
        return math.prod(self.sizes)

    def __len__(self) -> int:
        return len(self.attributes)


def _extras(c: ColumnSpec, *, unknown: bool) -> tuple[str, ...]:
    out: tuple[str, ...] = ()
    if unknown and c.unknown == "level":
        out += (UNKNOWN_TEXT,)
    if c.missing == "indicator":
        out += (MISSING,)
    return out


def _attribute(c: ColumnSpec, bins: int) -> Attribute:
    if c.role == "target":
        return Attribute(c.name, "target", tuple(c.levels))
    if c.type == "numeric":
        assert c.bounds is not None
        lo, hi = c.bounds
        width = (hi - lo) / bins
        labels = tuple(f"[{lo + i * width:.6g}, {lo + (i + 1) * width:.6g})" for i in range(bins))
        return Attribute(c.name, "numeric", labels + _extras(c, unknown=False), c.bounds, bins)
    if c.type == "boolean":
        return Attribute(c.name, "boolean", ("false", "true", *_extras(c, unknown=True)))
    return Attribute(c.name, c.type, tuple(c.levels) + _extras(c, unknown=True))


def domain_from_schema(schema: TableSchema, bins: int) -> Domain:
    """The domain of every used column of ``schema`` (text and ignored columns are left out)."""
    if isinstance(bins, bool) or not isinstance(bins, int) or not 2 <= bins <= 1000:
        raise ConfigError(
            "bins",
            bins,
            "numeric columns are modelled as bins of their public bounds",
            "pass 2 ≤ bins ≤ 1000",
        )
    attrs = [_attribute(c, bins) for c in schema.columns if c.used]
    if not attrs:
        raise ConfigError(
            "schema",
            "no used column",
            "there is nothing to synthesize",
            "declare at least one tabular column",
        )
    return Domain(tuple(attrs))


def codes_from_features(
    x: np.ndarray, y: np.ndarray | None, feature_names: list[str], schema: TableSchema, domain: Domain
) -> np.ndarray:
    """Integer codes (rows × attributes) from the encoder's features: a per-row, public mapping."""
    pos = {name: i for i, name in enumerate(feature_names)}
    out = np.zeros((x.shape[0], len(domain)), dtype=np.int64)
    for j, a in enumerate(domain.attributes):
        c = schema.column(a.name)
        if a.kind == "target":
            assert y is not None
            out[:, j] = y
            continue
        code = _value_codes(c, a, x, pos)
        for flag, label in ((":unknown", UNKNOWN_TEXT), (":missing", MISSING)):
            if label in a.labels and f"{c.name}{flag}" in pos:
                hit = x[:, pos[f"{c.name}{flag}"]] > 0.5
                code = np.where(hit, a.labels.index(label), code)
        if c.type == "categorical" and c.encoding == "embedding":
            raw = np.rint(x[:, pos[c.name]]).astype(np.int64)  # L unknown, L + 1 missing
            levels = len(c.levels)
            code = np.where(raw < levels, raw, -1)
            if UNKNOWN_TEXT in a.labels:
                code = np.where(raw == levels, a.labels.index(UNKNOWN_TEXT), code)
            if MISSING in a.labels:
                code = np.where(raw == levels + 1, a.labels.index(MISSING), code)
        out[:, j] = code
    return out


def _value_codes(c: ColumnSpec, a: Attribute, x: np.ndarray, pos: dict[str, int]) -> np.ndarray:
    if c.type == "numeric":
        v = x[:, pos[c.name]].astype(np.float64)  # scaled onto [-1, 1] by the encoder
        return np.clip(np.floor((v + 1.0) / 2.0 * a.bins), 0, a.bins - 1).astype(np.int64)
    if c.type == "boolean":
        return (x[:, pos[c.name]] > 0).astype(np.int64)
    if c.type == "ordinal":
        span = max(len(c.levels) - 1, 1)
        return np.clip(np.rint((x[:, pos[c.name]] + 1.0) * span / 2.0), 0, len(c.levels) - 1).astype(np.int64)
    if c.encoding == "embedding":
        return np.zeros(x.shape[0], dtype=np.int64)
    block = np.stack([x[:, pos[f"{c.name}={lv}"]] for lv in c.levels], axis=1)
    return np.argmax(block, axis=1).astype(np.int64)
