"""Readers of tables: CSV and Parquet through pyarrow, SQL databases through SQLAlchemy.

Sources are written ``csv:PATH``, ``parquet:PATH`` or ``sql:URL`` (any SQLAlchemy URL, e.g.
``sql:sqlite:///data.db`` or ``sql:postgresql+psycopg://user:pw@host/db``) with a ``table`` or a
``query``. A bare path ending in ``.csv``/``.parquet``/``.pq`` is read by its extension.

The readers are columnar and typed: CSV is parsed by pyarrow's multithreaded reader straight into
typed columns (numeric columns as float32 when a schema says so, categorical ones dictionary-encoded),
so a table costs about its typed size in memory, not Python objects per cell. SQL results are
fetched in partitions and converted to Arrow per partition.

One CSV reader for every job: tables, and the text and tabular loaders of ``veil train``
(:func:`read_csv_text`, every cell as written) all parse with pyarrow, one physical line per record
unless the data owner declares multi-line quoted values (:mod:`.csv_reader` says why); only
``\n``/``\r`` end a row, so U+0085 (NEL) or U+2028 inside a cell stays in its row. The delimiter
(``,``, ``;`` or tab) is read from the header line alone; the text encoding is declared
(``encoding=``, UTF-8 by default, e.g. ``latin-1``), never guessed from the rows.

These functions only read: they compute no statistic of the data, drop no row and fill no cell.
Every failure is a :class:`~veil.errors.DataError` with one line saying what and how to fix it;
database URLs are shown with the password hidden.

One module per source kind: :mod:`.common` (the source, the table as read, the column check),
:mod:`.csv_reader`, :mod:`.parquet_reader`, :mod:`.sql_reader`; this module picks the reader.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from veil.tables.sources import csv_reader, parquet_reader, sql_reader
from veil.tables.sources.common import (
    RawTable,
    TableSource,
    check_columns,
    hide_password,
    parse_source,
    refuse_password_in_url,
    url_has_password,
)
from veil.tables.sources.csv_reader import read_csv_text

if TYPE_CHECKING:
    from veil.tables.schema import TableSchema

__all__ = [
    "RawTable",
    "TableSource",
    "check_columns",
    "hide_password",
    "iter_source",
    "parse_source",
    "read_csv_text",
    "read_source",
    "refuse_password_in_url",
    "source_columns",
    "url_has_password",
]


def source_columns(source: TableSource) -> list[str]:
    """The column names, read from the header or metadata only."""
    if source.kind == "csv":
        return csv_reader.header(Path(source.location), source.encoding)
    if source.kind == "parquet":
        return list(parquet_reader.open_parquet(source).schema_arrow.names)
    return list(sql_reader.read_table(source, limit=0).column_names)


def read_source(
    source: TableSource,
    schema: TableSchema | None = None,
    *,
    need_target: bool = True,
    also: Sequence[str] = (),
) -> RawTable:
    """Read the table. With a schema: check the columns both ways and read only the used ones, typed
    (and the columns named in ``also``, e.g. an identifier the caller checked)."""
    present = source_columns(source)
    if schema is not None:
        check_columns(schema, present, source.describe(), need_target=need_target)
        wanted = [c.name for c in schema.columns if c.used and c.name in present] + list(also)
    else:
        wanted = present
    if source.kind == "csv":
        malformed = [0]
        multiline = csv_reader.multiline_values(source, schema)
        table = csv_reader.read_table(
            Path(source.location), schema, wanted, source.encoding, present, malformed, multiline
        )
        return RawTable(table, source, first_row=2, malformed=malformed[0])
    if source.kind == "parquet":
        return RawTable(parquet_reader.read_table(source, schema, wanted), source)
    # No refusal on the row count once the rows are read (a table or query with none goes on as zero
    # rows, as a header-only CSV: each job's rule on its public N decides).
    # A --table with a schema selects only the declared columns: an undeclared one is never computed.
    declared = list(dict.fromkeys(wanted)) if schema is not None and source.table else None
    table = sql_reader.read_table(source, columns=declared)
    return RawTable(table.select(wanted), source)


def iter_source(
    source: TableSource,
    schema: TableSchema,
    *,
    need_target: bool = True,
    batch_rows: int = 1 << 16,
    unit_column: str | None = None,
) -> tuple[int | None, Iterator[RawTable]]:
    """The table in batches, typed by the schema, and an upper bound on its row count (or None).

    CSV is parsed block by block (pyarrow's streaming reader; the bound is the file's line-end count,
    :func:`~veil.tables.sources.csv_reader.newline_count`),
    Parquet batch by batch within its row groups (the count is in its metadata); a SQL result comes
    as one batch. A consumer that writes each batch into a preallocated result holds at most one
    batch of Arrow data at a time.

    ``unit_column`` (a privacy unit, :mod:`veil.tables.units`): checked from the header before a row
    is read, then read too, as text, beside the used columns.
    """
    present = source_columns(source)
    check_columns(schema, present, source.describe(), need_target=need_target)
    wanted = [c.name for c in schema.columns if c.used and c.name in present]
    if unit_column is not None:
        from veil.tables.units import check_unit_column

        check_unit_column(schema, present, unit_column, source.describe())
        wanted.append(unit_column)
    if source.kind == "csv":
        path = Path(source.location)
        bound = None if path.name.lower().endswith(".gz") else csv_reader.newline_count(path, source.encoding)
        text = [unit_column] if unit_column else []
        return bound, csv_reader.read_batches(path, schema, wanted, source, present, text=text)
    if source.kind == "parquet":
        pf = parquet_reader.open_parquet(source)
        return int(pf.metadata.num_rows), parquet_reader.read_batches(pf, schema, wanted, source, batch_rows)
    raw = read_source(source, schema, need_target=need_target, also=wanted[-1:] if unit_column else ())
    return raw.table.num_rows, iter([raw])
