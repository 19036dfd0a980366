"""Real tables: a declared schema, a data-independent encoder, and readers for CSV, Parquet and SQL.

* :mod:`veil.tables.schema` — the TOML schema: each column's role, type and public domain, and the
  top-level ``reviewed = false | true | "dp"`` saying where those facts came from.
* :mod:`veil.tables.encoder` — columns → float32 features, fixed by the schema alone (one-hot or
  embedding codes over the declared levels plus an unknown level, missing indicators, numeric values
  clipped to their bounds and scaled); saved beside ``model.pt`` as ``encoder.json``.
* :mod:`veil.tables.sources` — typed, columnar readers: CSV and Parquet through pyarrow, SQL through
  SQLAlchemy (SQLite built in, PostgreSQL through psycopg).
* :mod:`veil.tables.infer` — ``veil schema infer``: a draft read from the data (``reviewed = false``),
  or a DP release of the domains (``reviewed = "dp"``, mechanisms in :mod:`veil.tables.release`).
* :mod:`veil.tables.stream` — Poisson-sampled batches streamed from a Parquet file larger than memory.

pyarrow, SQLAlchemy and psycopg are the optional extra ``veil[tables]``; importing this package
imports none of them (nor torch).
"""

from __future__ import annotations

from veil.tables.schema import ColumnSpec, TableSchema, load_schema, parse_schema, write_schema

__all__ = ["ColumnSpec", "TableSchema", "load_schema", "load_table", "parse_schema", "write_schema"]


def load_table(
    spec: str,
    schema: TableSchema,
    *,
    table: str | None = None,
    query: str | None = None,
    with_target: bool = True,
    unit_column: str | None = None,
) -> object:
    """Read ``spec`` and encode it with ``schema``: an :class:`~veil.tables.encoder.EncodedTable`.

    ``unit_column``: a privacy unit's column (:mod:`veil.tables.units`), checked before reading; its
    values (text, ``None`` when missing) come back in the table's ``units``, never as a feature."""
    from veil.tables.encoder import TableEncoder
    from veil.tables.sources import iter_source, parse_source

    source = parse_source(spec, table=table, query=query)
    rows, batches = iter_source(source, schema, need_target=with_target, unit_column=unit_column)
    units: list[object] = []
    if unit_column is not None:
        from veil.tables.units import collect_units

        batches = collect_units(batches, unit_column, units)
    encoded = TableEncoder(schema).encode_batches(
        rows, batches, with_target=with_target, where=source.describe(), drop=unit_column is None
    )
    if unit_column is not None:
        encoded.units = units
        assert encoded.dropped is not None
        if encoded.dropped.any():  # a row any rule drops (label or feature) takes its unit id along
            keep = ~encoded.dropped
            encoded.x = encoded.x[keep]
            encoded.y = encoded.y[keep] if encoded.y is not None else None
            encoded.units = [u for u, k in zip(units, keep, strict=True) if k]
    return encoded
