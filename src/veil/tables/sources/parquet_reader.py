"""Parquet files through pyarrow: the metadata, a typed read column by column, batches by row group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from veil.errors import DataError
from veil.tables.sources.common import RawTable, TableSource, first_line, need

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.schema import TableSchema

__all__ = ["open_parquet", "parquet_file", "read_batches", "read_table"]


def open_parquet(source: TableSource) -> Any:
    """The ``pyarrow.parquet.ParquetFile`` of ``source`` (metadata only; no row is read)."""
    return parquet_file(need("pyarrow.parquet", source.describe()), source)


def read_table(source: TableSource, schema: TableSchema | None, wanted: list[str]) -> pa.Table:
    """The ``wanted`` columns of the file, numeric features narrowed to float32."""
    pf = open_parquet(source)
    try:
        return _read_columns(pf, schema, wanted)
    except Exception as exc:
        raise DataError(
            "dataset file",
            source.location,
            f"it is not readable Parquet ({first_line(exc)})",
            "check it",
        ) from None


def read_batches(
    pf: Any, schema: TableSchema, wanted: list[str], source: TableSource, batch_rows: int
) -> Iterator[RawTable]:
    import pyarrow as pa

    offset = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=wanted):
        yield RawTable(pa.Table.from_batches([batch]), source, first_row=offset + 1)
        offset += batch.num_rows


def _read_columns(pf: Any, schema: TableSchema | None, wanted: list[str]) -> pa.Table:
    """Read column by column; numeric features stored as float64 are narrowed to float32 one at a time.

    So the peak is the float32 table plus one stored column, not the whole float64 table (the
    encoder's output is float32 anyway).
    """
    import pyarrow as pa

    numeric = {c.name for c in schema.features if c.type == "numeric"} if schema is not None else set()
    arrays = []
    for name in wanted:
        column = pf.read(columns=[name]).column(0)
        if name in numeric and pa.types.is_float64(column.type):
            column = column.cast(pa.float32())
        arrays.append(column)
    return pa.Table.from_arrays(arrays, names=wanted)


def parquet_file(pq: Any, source: TableSource) -> Any:
    try:
        return pq.ParquetFile(source.location)
    except Exception as exc:
        raise DataError(
            "dataset file",
            source.location,
            f"it is not readable Parquet ({first_line(exc)})",
            "check the file",
        ) from None
