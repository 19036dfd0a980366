"""How a dataset's training rows are spread over simulated clients: IID, Dirichlet(α) or a column.

A partition simulates who holds which data; it is not a release. Every client must hold at least one
row (an empty client is refused: its update would be the global model itself, and a federation
cannot be planned around a client that has nothing). The Dirichlet split follows Hsu et al. (2019):
for each class, the class's rows are divided among clients in proportions drawn from Dirichlet(α·1)
(small α: each client sees few classes). Splits are fixed by ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.errors import ConfigError, DataError

__all__ = ["Partition", "parse_partition", "split_rows"]

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


def _check_clients(clients: int, n: int) -> None:
    if clients < 1 or clients > n:
        raise ConfigError(
            "clients",
            clients,
            f"the {n} training rows cannot give every one of {clients} clients at least one row",
            f"pass --clients between 1 and {n}",
        )


def _iid(n: int, clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(n), clients)]


def _dirichlet(y: np.ndarray, clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for label in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == label))
        shares = rng.dirichlet(np.full(clients, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(rows)).astype(np.int64)
        for k, piece in enumerate(np.split(rows, cuts)):
            parts[k].append(piece)
    out = [np.sort(np.concatenate(p)) for p in parts]
    # Give an empty client one row from the largest client, so every client holds data (documented).
    for k in range(clients):
        if len(out[k]) == 0:
            donor = int(np.argmax([len(p) for p in out]))
            out[k], out[donor] = out[donor][-1:], out[donor][:-1]
    return out


def split_rows(
    partition: Partition,
    y: np.ndarray,
    clients: int,
    seed: int,
    column_values: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Row indices of each client, in client order. ``column_values`` is needed for ``column:NAME``."""
    n = len(y)
    rng = np.random.default_rng(seed)
    if partition.kind == "column":
        if column_values is None:
            raise DataError(
                "partition",
                str(partition),
                f"the data has no column named {partition.column!r} to assign rows to clients",
                "name an existing feature column, or use iid / dirichlet:ALPHA",
            )
        values = np.unique(column_values)
        if clients and clients != len(values):
            raise ConfigError(
                "clients",
                clients,
                f"column {partition.column!r} holds {len(values)} distinct values, one client each",
                f"pass --clients {len(values)} (or leave it out)",
            )
        return [np.flatnonzero(column_values == v) for v in values]
    _check_clients(clients, n)
    if partition.kind == "iid":
        return _iid(n, clients, rng)
    return _dirichlet(np.asarray(y), clients, partition.alpha, rng)


def check_non_empty(parts: list[np.ndarray]) -> None:
    """Refuse a client without rows (a DataError naming it)."""
    for k, rows in enumerate(parts):
        if len(rows) == 0:
            raise DataError(
                f"client {k}",
                "0 rows",
                "an empty client has no update to contribute and cannot run local training",
                "remove the client from the federation or give it data",
            )
