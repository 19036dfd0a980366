"""How a dataset's training rows are spread over simulated clients: IID, Dirichlet(α) or a column.

A partition simulates who holds which data; it is not a release. A client may hold no row: it then
contributes a zero update (never a refusal once the rows are read: whether a client is empty depends
on the data). The client count is declared, never checked against the data: more clients than rows
leaves the extra clients empty. The Dirichlet split follows Hsu et al. (2019):
for each class, the class's rows go to clients in proportions drawn from Dirichlet(α·1) (small α:
each client sees few classes). Splits are fixed by ``seed``.

Guarantee (record-local assignment). A row's client depends on that row alone: a keyed hash of its
content (:func:`row_positions`, as the train/test split's :func:`veil.data.held_out`) gives it a
position u in [0, 1), and the client is read off u — ``⌊u·K⌋`` (IID), or the class's Dirichlet
shares, drawn from the public ``seed`` alone, cut at u (Dirichlet); for ``column:NAME``, a keyed hash
of the row's value in that column, mod the declared client count (:func:`_by_value`: equal values
share a client, several values may share one, a client may be empty; the number of distinct values,
a fact of the data, never sets the client count or stops the run). So adding or removing one row of
the dataset changes exactly one client's data, by that row, and
no other client's: the property that lets the budget registry charge a federated run on one
dataset (its relation is add/remove one row of the whole dataset; :mod:`veil.federated.charge`).
A split by the rows' positions (a seeded permutation) would not have it: one added row reshuffles
every client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.data import row_hashes
from veil.errors import ConfigError, DataError

__all__ = ["Partition", "parse_partition", "row_positions", "split_rows"]

_FIX = "use iid, dirichlet:ALPHA (e.g. dirichlet:0.5) or column:NAME"


@dataclass(frozen=True)
class Partition:
    """A parsed ``--partition``: ``kind`` and its parameter (α or the column name)."""

    kind: Literal["iid", "dirichlet", "column"]
    alpha: float = 0.0
    column: str = ""

    def __str__(self) -> str:
        if self.kind == "dirichlet":
            return f"dirichlet:{self.alpha:g}"
        return f"column:{self.column}" if self.kind == "column" else "iid"


def parse_partition(spec: str) -> Partition:
    """``iid`` | ``dirichlet:ALPHA`` | ``column:NAME`` → :class:`Partition` (a ConfigError otherwise)."""
    kind, _, arg = str(spec).partition(":")
    if kind == "iid" and not arg:
        return Partition("iid")
    if kind == "dirichlet":
        try:
            alpha = float(arg)
        except ValueError:
            alpha = math.nan
        if not (math.isfinite(alpha) and alpha > 0):
            raise ConfigError("partition", spec, "the Dirichlet concentration α must be a number > 0", _FIX)
        return Partition("dirichlet", alpha=alpha)
    if kind == "column" and arg:
        return Partition("column", column=arg)
    raise ConfigError("partition", spec, "unknown partition of the data over clients", _FIX)


def row_positions(x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
    """Each row's position in [0, 1): a keyed BLAKE2b hash of its own features and label (key from
    ``seed``). Depends on the row alone, never on its index or on the other rows; equal rows share it."""
    labels = [str(int(v)) for v in np.asarray(y).astype(np.int64)]
    hashes = row_hashes(x, labels, "veil.partition", seed)
    return np.array([(h >> 11) * 2.0**-53 for h in hashes], dtype=np.float64)


def _iid(positions: np.ndarray, clients: int) -> list[np.ndarray]:
    owner = np.minimum((positions * clients).astype(np.int64), clients - 1)
    return [np.flatnonzero(owner == k) for k in range(clients)]


def _by_value(values: np.ndarray, clients: int, seed: int) -> list[np.ndarray]:
    """Client of each row = keyed BLAKE2b hash of its value (domain ``veil.partition.column``) mod
    ``clients``: a function of the value alone (each distinct value is hashed once)."""
    distinct, inverse = np.unique(np.asarray(values, dtype=np.float64), return_inverse=True)
    hashes = row_hashes(distinct.reshape(-1, 1), [""] * len(distinct), "veil.partition.column", seed)
    owner = np.array([h % clients for h in hashes], dtype=np.int64)[np.asarray(inverse).reshape(-1)]
    return [np.flatnonzero(owner == k) for k in range(clients)]


def _dirichlet(
    y: np.ndarray,
    positions: np.ndarray,
    clients: int,
    alpha: float,
    rng: np.random.Generator,
    num_classes: int,
) -> list[np.ndarray]:
    """Per class c, shares p_c ~ Dirichlet(α·1) from the public seed, drawn for every class of the
    public label set in order (so the draws never depend on which labels the rows hold)."""
    labels = np.asarray(y).astype(np.int64)
    owner = np.empty(len(labels), dtype=np.int64)
    for label in range(max(num_classes, int(labels.max()) + 1 if len(labels) else 0)):
        cuts = np.cumsum(rng.dirichlet(np.full(clients, alpha)))
        rows = np.flatnonzero(labels == label)
        owner[rows] = np.minimum(np.searchsorted(cuts, positions[rows], side="right"), clients - 1)
    return [np.flatnonzero(owner == k) for k in range(clients)]


def split_rows(
    partition: Partition,
    y: np.ndarray,
    clients: int,
    seed: int,
    column_values: np.ndarray | None = None,
    positions: np.ndarray | None = None,
    num_classes: int = 0,
) -> list[np.ndarray]:
    """Row indices of each client, in client order. ``column_values`` is needed for ``column:NAME``,
    ``positions`` (:func:`row_positions` of the rows) for ``iid`` and ``dirichlet``; ``num_classes``
    is the public label set's size (Dirichlet)."""
    n = len(y)
    rng = np.random.default_rng(seed)
    if clients < 1:
        raise ConfigError(
            "clients", clients, "the client count is declared, never read from the data", "pass --clients ≥ 1"
        )
    # More clients than rows is no refusal: the row count is a fact of the data, and the clients past
    # it are empty (a zero update each), as any client an unlucky split leaves empty.
    if partition.kind == "column":
        if column_values is None:
            raise DataError(
                "partition",
                str(partition),
                f"the data has no column named {partition.column!r} to assign rows to clients",
                "name an existing feature column, or use iid / dirichlet:ALPHA",
            )
        return _by_value(column_values, clients, seed)
    if positions is None or len(positions) != n:
        raise ValueError("an iid or Dirichlet split needs every row's position (row_positions)")
    if partition.kind == "iid":
        return _iid(np.asarray(positions), clients)
    return _dirichlet(np.asarray(y), np.asarray(positions), clients, partition.alpha, rng, num_classes)
