"""Readers of tables: CSV and Parquet through pyarrow, SQL databases through SQLAlchemy.

Sources are written ``csv:PATH``, ``parquet:PATH`` or ``sql:URL`` (any SQLAlchemy URL, e.g.
``sql:sqlite:///data.db`` or ``sql:postgresql+psycopg://user:pw@host/db``) with a ``table`` or a
``query``. A bare path ending in ``.csv``/``.parquet``/``.pq`` is read by its extension.

The readers are columnar and typed: CSV is parsed by pyarrow's multithreaded reader straight into
typed columns (numeric columns as float32 when a schema says so, categorical ones dictionary-encoded),
so a table costs about its typed size in memory, not Python objects per cell. SQL results are
fetched in partitions and converted to Arrow per partition.

These functions only read: they compute no statistic of the data, drop no row and fill no cell.
Every failure is a :class:`~veil.errors.DataError` with one line saying what and how to fix it;
database URLs are shown with the password hidden.
"""

from __future__ import annotations

import csv
import difflib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from veil.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.schema import TableSchema

__all__ = [
    "RawTable",
    "TableSource",
    "hide_password",
    "iter_source",
    "parse_source",
    "read_source",
    "refuse_password_in_url",
    "source_columns",
    "url_has_password",
]

SourceKind = Literal["csv", "parquet", "sql"]
SQL_PARTITION_ROWS = 65_536


@dataclass(frozen=True)
class TableSource:
    """Where a table lives; ``describe()`` is safe to print (no password)."""

    kind: SourceKind
    location: str
    table: str | None = None
    query: str | None = None

    def describe(self) -> str:
        if self.kind != "sql":
            return f"{self.kind}:{self.location}"
        what = f" table {self.table}" if self.table else " query"
        return f"sql:{hide_password(self.location)}{what}"


@dataclass
class RawTable:
    """A table as read, with the number its source gives to the first data row (CSV: line 2)."""

    table: pa.Table
    source: TableSource
    first_row: int = 1

    def row_label(self, index: int) -> str:
        if self.source.kind == "csv":
            return f"line {index + self.first_row}"
        return f"row {index + self.first_row}"


def url_has_password(url: str) -> bool:
    """Whether a database URL carries a password (which must then never be written anywhere)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).password is not None
    except Exception:
        return re.search(r"://[^:/@]+:[^@]*@", url) is not None


def refuse_password_in_url(url: str) -> None:
    """Refuse a database URL that carries a password: the run folder records the dataset's address."""
    if url_has_password(url):
        raise ConfigError(
            "dataset",
            "sql:" + hide_password(url),
            "the run folder records the dataset (config.toml, report), and a password in the URL would "
            "be written there beside the released model",
            "leave the password out of the URL and give it to the driver another way (PostgreSQL: the "
            "PGPASSWORD environment variable or ~/.pgpass)",
        )


def hide_password(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return str(make_url(url).render_as_string(hide_password=True))
    except Exception:
        return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def _need(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise DataError(
            "dataset",
            what,
            f"reading it needs the optional package {module.split('.')[0]}",
            "pip install 'veil[tables]'",
        ) from None


def parse_source(spec: str, *, table: str | None = None, query: str | None = None) -> TableSource:
    """``csv:PATH`` | ``parquet:PATH`` | ``sql:URL`` (with ``table`` or ``query``) | a .csv/.parquet path."""
    kind, sep, rest = spec.partition(":")
    if sep and kind in ("csv", "parquet", "sql") and rest:
        chosen: SourceKind = kind  # type: ignore[assignment]
    else:
        suffix = Path(spec).suffix.lower()
        if suffix in (".csv", ".txt") or spec.lower().endswith(".csv.gz"):
            chosen, rest = "csv", spec
        elif suffix in (".parquet", ".pq"):
            chosen, rest = "parquet", spec
        else:
            raise DataError(
                "dataset",
                spec,
                "unknown table source, so the data the guarantee protects cannot be identified",
                "write csv:PATH, parquet:PATH or sql:URL (with --table or --query)",
            )
    if chosen == "sql":
        if (table is None) == (query is None):
            raise DataError(
                "dataset",
                hide_password(rest),
                "a SQL source needs exactly one of a table name and a query",
                "pass --table NAME or --query 'SELECT ...'",
            )
        return TableSource("sql", rest, table=table, query=query)
    if table is not None or query is not None:
        raise DataError(
            "--table/--query", table or query, "only a sql: source has tables", "drop it, or use sql:URL"
        )
    p = Path(rest).expanduser()
    if not p.is_file():
        raise DataError("dataset file", str(p), "the file does not exist", f"check the path after {chosen}:")
    return TableSource(chosen, str(p))


# -- columns (header only) ----------------------------------------------------------------------


def source_columns(source: TableSource) -> list[str]:
    """The column names, read from the header or metadata only."""
    if source.kind == "csv":
        return _csv_header(Path(source.location))
    if source.kind == "parquet":
        pq = _need("pyarrow.parquet", source.describe())
        return list(_parquet_file(pq, source).schema_arrow.names)
    return list(_sql_read(source, limit=0).column_names)


def _csv_header(p: Path) -> list[str]:
    import gzip

    try:
        opener: Any = gzip.open if p.name.lower().endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8-sig", newline="") as fh:
            header = next(csv.reader(fh), None)
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            "dataset file",
            str(p),
            f"it cannot be read as UTF-8 text ({exc.__class__.__name__})",
            "save as UTF-8",
        ) from None
    if not header:
        raise DataError(
            "dataset file", str(p), "the CSV has no header row", "add a header naming the columns"
        )
    names = [h.strip() for h in header]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise DataError("CSV header", dup, "column names must be unique to be declared", "rename duplicates")
    return names


def check_columns(schema: TableSchema, present: Sequence[str], where: str, *, need_target: bool) -> None:
    """Every schema column must be in the data, and every data column in the schema."""
    have = set(present)
    for c in schema.columns:
        if c.name in have or (c.role == "target" and not need_target):
            continue
        close = difflib.get_close_matches(c.name, list(present), n=1)
        hint = f" (the data has '{close[0]}')" if close else ""
        raise DataError(
            f"schema column '{c.name}'",
            where,
            f"the column is declared in the schema but missing from the data{hint}",
            "fix the column name in the schema or the data, or remove it from the schema",
        )
    declared = set(schema.names)
    extra = [n for n in present if n not in declared]
    if extra:
        raise DataError(
            f"data column '{extra[0]}'",
            where,
            f"{len(extra)} column(s) of the data are not in the schema, and nothing undeclared is used",
            f'declare them, e.g. [columns."{extra[0]}"] type = "ignored" to leave one out',
        )


# -- reading ------------------------------------------------------------------------------------


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
        return RawTable(_read_csv(Path(source.location), schema, wanted), source, first_row=2)
    if source.kind == "parquet":
        pq = _need("pyarrow.parquet", source.describe())
        try:
            table = _read_parquet(_parquet_file(pq, source), schema, wanted)
        except Exception as exc:
            raise DataError(
                "dataset file",
                source.location,
                f"it is not readable Parquet ({_first_line(exc)})",
                "check it",
            ) from None
        return RawTable(table, source)
    table = _sql_read(source)
    if table.num_rows == 0:
        raise DataError(
            "dataset",
            source.describe(),
            "the table or query returned no rows, so there is nothing to train on",
            "check the table name, the query's WHERE clause and the database",
        )
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

    CSV is parsed block by block (pyarrow's streaming reader; the bound is the file's newline count),
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
        bound = None if path.name.lower().endswith(".gz") else _newlines(path)
        return bound, _csv_batches(path, schema, wanted, source, text=[unit_column] if unit_column else [])
    if source.kind == "parquet":
        pq = _need("pyarrow.parquet", source.describe())
        pf = _parquet_file(pq, source)
        return int(pf.metadata.num_rows), _parquet_batches(pf, schema, wanted, source, batch_rows)
    raw = read_source(source, schema, need_target=need_target, also=wanted[-1:] if unit_column else ())
    return raw.table.num_rows, iter([raw])


def _newlines(path: Path) -> int:
    """Newlines in the file: at least the number of data rows (+1 for a last line without one)."""
    count = 0
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            count += block.count(b"\n")
    return count + 1


def _csv_batches(
    path: Path, schema: TableSchema, wanted: list[str], source: TableSource, text: Sequence[str] = ()
) -> Iterator[RawTable]:
    pa_csv = _need("pyarrow.csv", source.describe())
    import pyarrow as pa

    missing = list(schema.missing_values)
    convert = pa_csv.ConvertOptions(
        column_types={**_csv_types(schema), **{name: pa.string() for name in text}},
        null_values=missing,
        strings_can_be_null=True,
        include_columns=wanted,
        true_values=["true", "True", "TRUE"],
        false_values=["false", "False", "FALSE"],
    )
    offset = 0
    try:
        reader = pa_csv.open_csv(
            path, convert_options=convert, read_options=pa_csv.ReadOptions(block_size=1 << 22)
        )
        for batch in reader:
            if batch.num_rows:
                yield RawTable(pa.Table.from_batches([batch]), source, first_row=offset + 2)
                offset += batch.num_rows
    except pa.ArrowInvalid as exc:
        _csv_error(path, schema, exc)


def _parquet_batches(
    pf: Any, schema: TableSchema, wanted: list[str], source: TableSource, batch_rows: int
) -> Iterator[RawTable]:
    import pyarrow as pa

    offset = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=wanted):
        yield RawTable(pa.Table.from_batches([batch]), source, first_row=offset + 1)
        offset += batch.num_rows


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


def _csv_types(schema: TableSchema | None) -> dict[str, Any]:
    import pyarrow as pa

    if schema is None:
        return {}
    types: dict[str, Any] = {}
    for c in schema.columns:
        if not c.used:
            continue
        if c.type == "numeric" and c.role == "feature":
            types[c.name] = pa.float32()
        elif c.type in ("categorical", "ordinal") or c.role == "target":
            types[c.name] = pa.dictionary(pa.int32(), pa.string())
        else:
            types[c.name] = pa.string()
    return types


def _read_csv(p: Path, schema: TableSchema | None, wanted: list[str]) -> pa.Table:
    pa_csv = _need("pyarrow.csv", f"csv:{p}")
    import pyarrow as pa

    from veil.tables.schema import DEFAULT_MISSING_VALUES

    missing = list(schema.missing_values if schema is not None else DEFAULT_MISSING_VALUES)
    types = _csv_types(schema)
    convert = pa_csv.ConvertOptions(
        column_types=types,
        null_values=missing,
        strings_can_be_null=True,
        include_columns=wanted,
        true_values=["true", "True", "TRUE"],
        false_values=["false", "False", "FALSE"],
    )
    try:
        return pa_csv.read_csv(p, convert_options=convert)
    except pa.ArrowInvalid as exc:
        _csv_error(p, schema, exc)


def _csv_error(p: Path, schema: TableSchema | None, exc: Exception) -> NoReturn:
    """Turn pyarrow's parse error into one line; for a numeric column, name the first bad cell."""
    import pyarrow as pa

    message = _first_line(exc)
    found = re.search(r"column #(\d+)", message)
    if found and schema is not None:
        names = _csv_header(p)
        column = names[int(found.group(1))] if int(found.group(1)) < len(names) else "?"
        if _csv_types(schema).get(column) == pa.float32():
            _locate_not_number(p, column, list(schema.missing_values))
    raise DataError("dataset file", str(p), f"the CSV cannot be parsed ({message})", "fix the file") from None


def _locate_not_number(p: Path, column: str, missing: list[str]) -> None:
    """Name the first cell of a numeric column that is not a number (called on the error path only)."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    table = pa_csv.read_csv(
        p,
        convert_options=pa_csv.ConvertOptions(
            column_types={column: pa.string()},
            include_columns=[column],
            null_values=missing,
            strings_can_be_null=True,
        ),
    )
    for i, cell in enumerate(table.column(0).to_pylist()):
        if cell is None:
            continue
        try:
            float(cell)
        except ValueError:
            raise DataError(
                f"line {i + 2} column '{column}'",
                cell,
                "the schema declares the column numeric but this cell is not a number (a type mismatch); "
                "veil neither guesses nor drops rows",
                "fix the cell, list it in missing_values if it means 'missing', or declare the column "
                "categorical",
            ) from None


def _read_parquet(pf: Any, schema: TableSchema | None, wanted: list[str]) -> pa.Table:
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


def _parquet_file(pq: Any, source: TableSource) -> Any:
    try:
        return pq.ParquetFile(source.location)
    except Exception as exc:
        raise DataError(
            "dataset file",
            source.location,
            f"it is not readable Parquet ({_first_line(exc)})",
            "check the file",
        ) from None


# -- SQL ----------------------------------------------------------------------------------------


def _engine(source: TableSource) -> Any:
    sqlalchemy = _need("sqlalchemy", source.describe())
    from sqlalchemy.engine import make_url

    try:
        url = make_url(source.location)
    except Exception:
        url = None
    database = str(url.database or "") if url is not None else ""
    if (
        url is not None
        and url.get_backend_name() == "sqlite"
        and database not in ("", ":memory:")
        and not database.startswith("file:")
        and not Path(database).expanduser().is_file()
    ):
        # SQLite would create an empty database file: reading must write nothing.
        raise DataError(
            "dataset",
            source.describe(),
            "the SQLite database file does not exist",
            "check the path in the URL",
        )
    try:
        return sqlalchemy.create_engine(source.location)
    except Exception as exc:
        raise DataError(
            "dataset",
            source.describe(),
            f"not a usable database URL ({_first_line(exc)})",
            "write sql:DIALECT[+DRIVER]://USER:PASSWORD@HOST/DB, e.g. sql:sqlite:///data.db",
        ) from None


def _connect_error(source: TableSource, exc: BaseException) -> DataError:
    text = _first_line(getattr(exc, "orig", None) or exc)
    lowered = str(exc).lower()
    if "password authentication failed" in lowered or "access denied" in lowered:
        return DataError(
            "dataset",
            source.describe(),
            "the database refused the user name or password",
            "check the user and password in the URL (or the PGPASSWORD/.pgpass the driver reads)",
        )
    return DataError(
        "dataset",
        source.describe(),
        f"the database cannot be reached ({text})",
        "check the host, port and database name, and that the server is running",
    )


def _sql_read(source: TableSource, limit: int | None = None) -> pa.Table:
    """Run the table read or query; ``limit=0`` fetches the column names only."""
    import pyarrow as pa

    sqlalchemy = _need("sqlalchemy", source.describe())
    from sqlalchemy import exc as sa_exc

    engine = _engine(source)
    try:
        try:
            conn = engine.connect()
        except sa_exc.SQLAlchemyError as exc:
            raise _connect_error(source, exc) from None
        with conn:
            statement = _statement(sqlalchemy, conn, source, limit)
            try:
                result = conn.execution_options(stream_results=True).execute(statement)
            except sa_exc.SQLAlchemyError as exc:
                raise DataError(
                    "query" if source.query else "table",
                    source.query or source.table,
                    f"the database refused it ({_first_line(getattr(exc, 'orig', None) or exc)})",
                    "check the SQL and the table and column names",
                ) from None
            names = [str(k) for k in result.keys()]  # noqa: SIM118 - a Result, not a dict
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup is not None:
                raise DataError(
                    "query columns", dup, "two result columns share a name", "alias them apart (AS ...)"
                )
            if limit == 0:
                result.close()
                return pa.table({n: pa.array([], pa.null()) for n in names})
            parts = [_partition(names, rows) for rows in result.partitions(SQL_PARTITION_ROWS)]
    finally:
        engine.dispose()
    if not parts:
        return pa.table({n: pa.array([], pa.null()) for n in names})
    return pa.concat_tables(parts, promote_options="permissive")


def _partition(names: list[str], rows: Sequence[Sequence[Any]]) -> pa.Table:
    """Rows of a result partition → an Arrow table, column by column (types inferred by Arrow)."""
    import pyarrow as pa

    columns = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    return pa.table({n: pa.array(list(c)) for n, c in zip(names, columns, strict=True)})


def _statement(sqlalchemy: Any, conn: Any, source: TableSource, limit: int | None) -> Any:
    if source.query is not None:
        text = source.query.strip().rstrip(";")
        if limit == 0:
            text = f"SELECT * FROM ({text}) AS veil_q WHERE 1 = 0"
        return sqlalchemy.text(text)
    assert source.table is not None
    schema_name, _, name = source.table.rpartition(".")
    inspector = sqlalchemy.inspect(conn)
    if not inspector.has_table(name, schema=schema_name or None):
        known = inspector.get_table_names(schema=schema_name or None)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise DataError(
            "table",
            source.table,
            "the database has no such table",
            f"{hint}tables there: {', '.join(known[:15]) or 'none'}",
        )
    table = sqlalchemy.Table(name, sqlalchemy.MetaData(), schema=schema_name or None, autoload_with=conn)
    statement = sqlalchemy.select(table)
    return statement.where(sqlalchemy.false()) if limit == 0 else statement
