"""Readers of tables: CSV and Parquet through pyarrow, SQL databases through SQLAlchemy.

Sources are written ``csv:PATH``, ``parquet:PATH`` or ``sql:URL`` (any SQLAlchemy URL, e.g.
``sql:sqlite:///data.db`` or ``sql:postgresql+psycopg://user:pw@host/db``) with a ``table`` or a
``query``. A bare path ending in ``.csv``/``.parquet``/``.pq`` is read by its extension.

The readers are columnar and typed: CSV is parsed by pyarrow's multithreaded reader straight into
typed columns (numeric columns as float32 when a schema says so, categorical ones dictionary-encoded),
so a table costs about its typed size in memory, not Python objects per cell. SQL results are
fetched in partitions and converted to Arrow per partition.

One CSV reader for every job: tables, and the text and tabular loaders of ``veil train``
(:func:`read_csv_text`, every cell as written) all parse with pyarrow, quoted newlines allowed in
values; only ``\n``/``\r`` end a row, so U+0085 (NEL) or U+2028 inside a cell stays in its row. The
delimiter (``,``, ``;`` or tab) is read from the header line alone; the text encoding is declared
(``encoding=``, UTF-8 by default, e.g. ``latin-1``), never guessed from the rows.

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
    "read_csv_text",
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
    encoding: str = "utf-8"  # of a CSV file: declared, never guessed

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


def parse_source(
    spec: str, *, table: str | None = None, query: str | None = None, encoding: str = "utf-8"
) -> TableSource:
    """``csv:PATH`` | ``parquet:PATH`` | ``sql:URL`` (with ``table`` or ``query``) | a .csv/.parquet path.

    ``encoding``: the text encoding of a CSV file (a Python codec name: ``utf-8``, ``latin-1``, ...)."""
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
    return TableSource(chosen, str(p), encoding=_check_encoding(encoding))


def _check_encoding(encoding: str) -> str:
    import codecs

    try:
        return codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise DataError(
            "encoding", encoding, "the CSV's text encoding must be a known codec", "pass utf-8 or latin-1"
        ) from None


# -- columns (header only) ----------------------------------------------------------------------


def source_columns(source: TableSource) -> list[str]:
    """The column names, read from the header or metadata only."""
    if source.kind == "csv":
        return _csv_header(Path(source.location), source.encoding)
    if source.kind == "parquet":
        pq = _need("pyarrow.parquet", source.describe())
        return list(_parquet_file(pq, source).schema_arrow.names)
    return list(_sql_read(source, limit=0).column_names)


def _open_text(p: Path, encoding: str) -> Any:
    import gzip

    opener: Any = gzip.open if p.name.lower().endswith(".gz") else open
    codec = "utf-8-sig" if encoding in ("utf-8", "utf_8") else encoding
    return opener(p, "rt", encoding=codec, newline="")


def _csv_header(p: Path, encoding: str = "utf-8") -> list[str]:
    try:
        with _open_text(p, encoding) as fh:
            header = next(csv.reader(fh, delimiter=_delimiter(p, encoding)), None)
    except (OSError, UnicodeDecodeError) as exc:
        raise _not_decodable(p, encoding, exc) from None
    if not header:
        raise DataError(
            "dataset file", str(p), "the CSV has no header row", "add a header naming the columns"
        )
    names = [h.strip() for h in header]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise DataError("CSV header", dup, "column names must be unique to be declared", "rename duplicates")
    return names


def _not_decodable(p: Path, encoding: str, exc: BaseException) -> DataError:
    return DataError(
        "dataset file",
        str(p),
        f"it cannot be read as {encoding} text ({exc.__class__.__name__})",
        "save it as UTF-8, or declare its encoding (e.g. encoding='latin-1')",
    )


def _delimiter(p: Path, encoding: str) -> str:
    """``,``, ``;`` or tab: whichever occurs most in the header line (the first line), ``,`` on a tie."""
    try:
        with _open_text(p, encoding) as fh:
            first = fh.readline()
    except (OSError, UnicodeDecodeError) as exc:
        raise _not_decodable(p, encoding, exc) from None
    counts = {d: first.count(d) for d in (",", ";", "\t")}
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] > counts[","] else ","


def _csv_options(
    p: Path, encoding: str, names: list[str], block_size: int | None = None, skip: int = 0
) -> dict[str, Any]:
    """pyarrow's read and parse options shared by every CSV read: the header's (stripped) names, the
    declared encoding, the header's delimiter, and newlines allowed inside quoted values."""
    import pyarrow.csv as pa_csv

    read = pa_csv.ReadOptions(
        column_names=names,
        skip_rows=1,
        skip_rows_after_names=skip,
        encoding=encoding,
        **({"block_size": block_size} if block_size else {}),
    )
    parse = pa_csv.ParseOptions(delimiter=_delimiter(p, encoding), newlines_in_values=True)
    return {"read_options": read, "parse_options": parse}


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
        table = _read_csv(Path(source.location), schema, wanted, source.encoding, present)
        return RawTable(table, source, first_row=2)
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
        text = [unit_column] if unit_column else []
        return bound, _csv_batches(path, schema, wanted, source, present, text=text)
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
    path: Path,
    schema: TableSchema,
    wanted: list[str],
    source: TableSource,
    names: list[str],
    *,
    text: Sequence[str] = (),
    numbers_as_text: bool = False,
    skip: int = 0,
) -> Iterator[RawTable]:
    """The CSV block by block. A cell of a numeric column that is not a number stops pyarrow's typed
    reader; the rest of the file is then read with those columns as text, from the first row not yet
    yielded, and the encoder makes such a cell missing (a per-record rule, never a refusal)."""
    pa_csv = _need("pyarrow.csv", source.describe())
    import pyarrow as pa

    missing = list(schema.missing_values)
    convert = pa_csv.ConvertOptions(
        column_types={
            **_csv_types(schema, numbers_as_text=numbers_as_text),
            **{name: pa.string() for name in text},
        },
        null_values=missing,
        strings_can_be_null=True,
        include_columns=wanted,
        true_values=["true", "True", "TRUE"],
        false_values=["false", "False", "FALSE"],
    )
    offset = skip
    try:
        reader = pa_csv.open_csv(
            path, convert_options=convert, **_csv_options(path, source.encoding, names, 1 << 22, skip)
        )
        for batch in reader:
            if batch.num_rows:
                yield RawTable(pa.Table.from_batches([batch]), source, first_row=offset + 2)
                offset += batch.num_rows
    except pa.ArrowInvalid as exc:
        if numbers_as_text or not _conversion_error(exc):
            _csv_error(path, exc)
        retry = True
    else:
        retry = False
    if retry:
        yield from _csv_batches(
            path, schema, wanted, source, names, text=text, numbers_as_text=True, skip=offset
        )


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


def _conversion_error(exc: BaseException) -> bool:
    """pyarrow could not convert a cell to its column's type (not a malformed row)."""
    return "conversion error" in str(exc)


def _csv_types(schema: TableSchema | None, *, numbers_as_text: bool = False) -> dict[str, Any]:
    """Column types for pyarrow's reader; numeric features as float32, or as text (then converted by
    the encoder, which makes a cell that is not a number missing)."""
    import pyarrow as pa

    if schema is None:
        return {}
    types: dict[str, Any] = {}
    for c in schema.columns:
        if not c.used:
            continue
        if c.type == "numeric" and c.role == "feature":
            types[c.name] = pa.string() if numbers_as_text else pa.float32()
        elif c.type in ("categorical", "ordinal") or c.role == "target":
            types[c.name] = pa.dictionary(pa.int32(), pa.string())
        else:
            types[c.name] = pa.string()
    return types


def _read_csv(
    p: Path,
    schema: TableSchema | None,
    wanted: list[str],
    encoding: str = "utf-8",
    names: list[str] | None = None,
) -> pa.Table:
    pa_csv = _need("pyarrow.csv", f"csv:{p}")
    import pyarrow as pa

    from veil.tables.schema import DEFAULT_MISSING_VALUES

    missing = list(schema.missing_values if schema is not None else DEFAULT_MISSING_VALUES)
    names = names if names is not None else _csv_header(p, encoding)
    for numbers_as_text in (False, True):  # a cell that is not a number: read those columns as text
        convert = pa_csv.ConvertOptions(
            column_types=_csv_types(schema, numbers_as_text=numbers_as_text),
            null_values=missing,
            strings_can_be_null=True,
            include_columns=wanted,
            true_values=["true", "True", "TRUE"],
            false_values=["false", "False", "FALSE"],
        )
        try:
            return pa_csv.read_csv(p, convert_options=convert, **_csv_options(p, encoding, names))
        except pa.ArrowInvalid as exc:
            if numbers_as_text or not _conversion_error(exc):
                _csv_error(p, exc)
    raise AssertionError("unreachable")  # pragma: no cover


def read_csv_text(source: TableSource) -> dict[str, list[str]]:
    """A CSV's every cell as written (text, no type inference, no missing-value markers), by column:
    the table reader with all columns read as strings, for loaders that parse cells themselves."""
    if source.kind != "csv":
        raise DataError("dataset", source.describe(), "only a CSV is read as text cells", "pass csv:PATH")
    pa_csv = _need("pyarrow.csv", source.describe())
    import pyarrow as pa

    p = Path(source.location)
    names = _csv_header(p, source.encoding)
    convert = pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in names},
        null_values=[],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    try:
        table = pa_csv.read_csv(p, convert_options=convert, **_csv_options(p, source.encoding, names))
    except pa.ArrowInvalid as exc:
        _csv_error(p, exc)
    return {name: table.column(name).to_pylist() for name in names}


def _csv_error(p: Path, exc: Exception) -> NoReturn:
    """pyarrow's parse error as one line that names the row, never its content (pyarrow's own message
    quotes the row, which holds private values)."""
    message = _first_line(exc)
    ragged = re.search(r"Expected (\d+) columns, got (\d+)", message)
    if ragged:
        line = _ragged_line(p, int(ragged.group(1)))
        raise DataError(
            f"line {line}" if line is not None else "a row",
            f"{ragged.group(2)} fields (row not shown)",
            f"the CSV header has {ragged.group(1)} columns and every row must have as many",
            "fix that row of the file (a field with a comma or a newline must be quoted)",
        ) from None
    raise DataError(
        "dataset file",
        str(p),
        f"the CSV cannot be parsed ({message.split(':')[0]}; the parser's detail is not shown: it may "
        "quote a private row)",
        "check the file's quoting and encoding",
    ) from None


def _ragged_line(p: Path, columns: int) -> int | None:
    """The line on which the first row with another number of fields than ``columns`` ends (on the
    error path only)."""
    try:
        with _open_text(p, "utf-8") as fh:
            reader = csv.reader(fh, delimiter=_delimiter(p, "utf-8"))
            next(reader, None)
            for record in reader:
                if record and len(record) != columns:
                    return reader.line_num
    except (OSError, UnicodeDecodeError, csv.Error, DataError):
        return None
    return None


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
