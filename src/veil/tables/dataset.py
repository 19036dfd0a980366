"""A table read and encoded through its schema, as the training pipeline's :class:`~veil.data.Dataset`.

What comes from where: the features are the encoder's (public, per-row: :mod:`veil.tables.encoder`),
the label set and its order are the schema's declared classes (public), and nothing is computed from
the rows except the split. An unreviewed schema is refused before a row is read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from veil.tables.schema import load_schema

if TYPE_CHECKING:
    from veil.data import Dataset
    from veil.tables.encoder import TableEncoder

__all__ = ["load_schema_dataset", "source_fingerprint"]


def source_fingerprint(spec: str, table: str | None, query: str | None) -> str:
    """SHA-256 of a file's bytes, or of a SQL source's address (password hidden) and table/query."""
    from veil.tables.sources import parse_source

    source = parse_source(spec, table=table, query=query)
    h = hashlib.sha256()
    if source.kind == "sql":
        h.update(source.describe().encode())
        h.update((source.query or source.table or "").encode())
        return h.hexdigest()
    with Path(source.location).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_schema_dataset(
    spec: str,
    schema_path: str,
    *,
    table: str | None = None,
    query: str | None = None,
    test_fraction: float,
    seed: int,
) -> tuple[Dataset, TableEncoder]:
    """Read ``spec`` with the reviewed schema, encode it, split it; returns the dataset and its encoder."""
    from veil.data import Dataset, check_labels, split
    from veil.tables import load_table
    from veil.tables.encoder import EncodedTable, TableEncoder
    from veil.tables.sources import parse_source

    schema = load_schema(schema_path)
    schema.require_reviewed(schema_path)
    target = schema.require_target("training")
    encoder = TableEncoder(schema)
    encoded = load_table(spec, schema, table=table, query=query)
    assert isinstance(encoded, EncodedTable) and encoded.y is not None
    check_labels(encoded.y, list(target.levels), f"target '{target.name}'")
    x_tr, y_tr, x_te, y_te = split(encoded.x, encoded.y, test_fraction, seed)
    provenance = 'released with DP (reviewed = "dp")' if schema.reviewed == "dp" else "declared public"
    data = Dataset(
        name=parse_source(spec, table=table, query=query).describe(),
        kind="table",
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        classes=list(target.levels),
        sha256=source_fingerprint(spec, table, query),
        preset="table",
        feature_names=list(encoder.feature_names),
        notes=[
            f"features encoded by the schema {schema_path}: {provenance}; "
            f"{encoder.width} features, classes {', '.join(target.levels)}"
        ],
    )
    return data, encoder
