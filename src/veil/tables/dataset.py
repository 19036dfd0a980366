"""A table read and encoded through its schema, for the training pipeline (``veil.data`` splits it).

What comes from where: the features are the encoder's (public, per-row: :mod:`veil.tables.encoder`),
the label set and its order are the schema's declared classes (public), and nothing is computed from
the rows except the split. An unreviewed schema is refused before a row is read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from veil.tables.encoder import EncodedTable, TableEncoder
from veil.tables.schema import load_schema

__all__ = ["SchemaTable", "load_schema_table", "source_fingerprint"]


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


@dataclass
class SchemaTable:
    """A table read and encoded through its reviewed schema, before any split."""

    encoded: EncodedTable
    encoder: TableEncoder
    name: str
    """The source, safe to print (password hidden)."""
    fingerprint: str
    notes: list[str]


def load_schema_table(
    spec: str,
    schema_path: str,
    *,
    table: str | None = None,
    query: str | None = None,
    unit_column: str | None = None,
) -> SchemaTable:
    """Read ``spec`` with the reviewed schema and encode it (refused before reading if unreviewed).

    ``unit_column``: also read the privacy unit's ids (``encoded.units``; see :mod:`veil.tables.units`)."""
    from veil.tables import load_table
    from veil.tables.encoder import EncodedTable, TableEncoder
    from veil.tables.sources import parse_source

    schema = load_schema(schema_path)
    schema.require_reviewed(schema_path)
    target = schema.require_target("training")
    encoder = TableEncoder(schema)
    encoded = load_table(spec, schema, table=table, query=query, unit_column=unit_column)
    assert isinstance(encoded, EncodedTable) and encoded.y is not None
    provenance = 'released with DP (reviewed = "dp")' if schema.reviewed == "dp" else "declared public"
    notes = [
        f"features encoded by the schema {schema_path}: {provenance}; "
        f"{encoder.width} features, classes {', '.join(target.levels)}"
    ]
    name = parse_source(spec, table=table, query=query).describe()
    return SchemaTable(encoded, encoder, name, source_fingerprint(spec, table, query), notes)
