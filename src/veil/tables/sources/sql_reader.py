"""SQL databases through SQLAlchemy: a table or a query, fetched in partitions and converted to Arrow.

Reading writes nothing: a SQLite URL naming a file that does not exist is refused (SQLite would create
it). Errors show the URL with its password hidden.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.errors import DataError
from veil.tables.sources.cells import column_texts, mixed_cells_as_text
from veil.tables.sources.common import TableSource, first_line, need

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["SQL_PARTITION_ROWS", "read_table"]

SQL_PARTITION_ROWS = 65_536


def _engine(source: TableSource) -> Any:
    sqlalchemy = need("sqlalchemy", source.describe())
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
        engine = sqlalchemy.create_engine(source.location)
    except Exception as exc:
        raise DataError(
            "dataset",
            source.describe(),
            f"not a usable database URL ({first_line(exc)})",
            "write sql:DIALECT[+DRIVER]://USER:PASSWORD@HOST/DB, e.g. sql:sqlite:///data.db",
        ) from None
    if engine.dialect.driver == "psycopg":
        sqlalchemy.event.listen(engine, "connect", _text_loaders)
    if engine.dialect.driver == "pysqlite":
        sqlalchemy.event.listen(engine, "connect", _sqlite_text_factory)
    return engine


def _sqlite_text_factory(dbapi_connection: Any, _record: Any) -> None:
    """SQLite TEXT as UTF-8, a byte that is not valid there read as U+FFFD in its own cell (the CSV
    reader's rule): the default factory raised on one record's bytes after the run was charged."""
    dbapi_connection.text_factory = lambda raw: raw.decode("utf-8", "replace")


_AS_TEXT = ("date", "time", "timetz", "timestamp", "timestamptz", "interval", "json", "jsonb")
"""PostgreSQL types psycopg converts in ways that can fail on one stored value (a date past year
9999 or BC, ``infinity``, a JSON number longer than Python's integer-string limit), naming it."""


def _text_loaders(dbapi_connection: Any, _record: Any) -> None:
    """Load :data:`_AS_TEXT` types as the server writes them (arrays of them too): never a conversion
    error on one record's value, and each cell's text is its own (the cell rule applies to it)."""
    from psycopg.types.string import TextLoader

    for name in _AS_TEXT:
        dbapi_connection.adapters.register_loader(name, TextLoader)


def _connect_error(source: TableSource, exc: BaseException) -> DataError:
    text = first_line(getattr(exc, "orig", None) or exc)
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


#: The one message of any failure of a read statement (the column check under ``WHERE 1 = 0`` or the
#: full read, at ``execute`` or while fetching): the database's own text is never shown, as it can
#: quote a stored value. A ``--query`` is the user's SQL: text that closes the check's parenthesis
#: runs a SELECT over the rows outside ``WHERE 1 = 0`` (review revG F1), and a table name can be a
#: view the database evaluates (MySQL materializes some before the ``WHERE``).
_READ_FAILED = (
    "the database refused {what} or failed while running it (the database's message is not shown: "
    "it may quote a stored value)"
)
_QUERY_FIX = (
    "run the query yourself on the database to see its error, and check its tables and columns "
    "against the database's schema; make it total: no cast or parse that can fail on a stored "
    "value; select the column as stored (CAST(col AS TEXT) where the driver cannot convert it) and "
    "let the schema's cell rules convert it (see docs/tables.md)"
)
_TABLE_FIX = (
    "run SELECT * FROM the table yourself on the database to see its error (the user's rights on "
    "it, a view that fails over the rows)"
)


def _read_failed(source: TableSource) -> DataError:
    """The fixed error of a read statement that failed: the same whichever statement, record or place
    (nothing of the database's text, which can quote a stored value)."""
    if source.query is not None:
        return DataError("query", source.query, _READ_FAILED.format(what="the query"), _QUERY_FIX)
    return DataError("table", str(source.table), _READ_FAILED.format(what="reading the table"), _TABLE_FIX)


def read_table(source: TableSource, limit: int | None = None) -> pa.Table:
    """Run the table read or query; ``limit=0`` fetches the column names only.

    ``limit=0`` runs the statement under ``WHERE 1 = 0`` (for a table or a well-formed query no row
    is evaluated); :func:`veil.tables.sources.read_source` runs it before every full read.
    Guarantee: the database's own error text is never shown for a read statement, the column check
    or the full read, at ``execute`` or while fetching: any failure is one fixed message,
    :func:`_read_failed`, whatever statement, record or place caused it. The text can quote a stored
    value (PostgreSQL's ``invalid input syntax for type integer: "<value>"``, SQLite's ``JSON path
    error near '<value>'``), and veil does not parse the user's SQL: a ``--query`` that closes the
    check's parenthesis runs a SELECT over the rows outside ``WHERE 1 = 0``. A failure over the rows
    cannot become a per-record rule, as the database computes the query: the caller's reservation is
    kept, nothing released. Connection errors keep their text (host, port, database: no stored
    value)."""
    import pyarrow as pa

    sqlalchemy = need("sqlalchemy", source.describe())
    from sqlalchemy import exc as sa_exc

    engine = _engine(source)
    if limit == 0 and source.query is not None and engine.dialect.name == "sqlite":
        try:
            names = _sqlite_columns_without_rows(engine, source)
        finally:
            engine.dispose()
        if names is not None:
            _check_unique(names)
            return pa.table({n: pa.array([], pa.null()) for n in names})
        engine = _engine(source)  # the fallback check below, on a fresh engine
    try:
        try:
            conn = engine.connect()
        except sa_exc.SQLAlchemyError as exc:
            raise _connect_error(source, exc) from None
        with conn:
            statement = _statement(sqlalchemy, conn, source, limit)
            try:
                result = conn.execution_options(stream_results=True).execute(statement)
            except Exception:
                raise _read_failed(source) from None
            names = [str(k) for k in result.keys()]  # noqa: SIM118 - a Result, not a dict
            _check_unique(names)
            if limit == 0:
                result.close()
                return pa.table({n: pa.array([], pa.null()) for n in names})
            try:
                parts = [_partition(names, rows) for rows in result.partitions(SQL_PARTITION_ROWS)]
            except Exception:
                # The usual driver conversions are avoided upstream (`_text_loaders`, `_statement`);
                # this is the backstop, with the same message as a failure at execute.
                raise _read_failed(source) from None
    finally:
        engine.dispose()
    if not parts:
        return pa.table({n: pa.array([], pa.null()) for n in names})
    return pa.concat_tables(_one_type_per_column(parts), promote_options="permissive")


def _check_unique(names: list[str]) -> None:
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise DataError("query columns", dup, "two result columns share a name", "alias them apart (AS ...)")


def _sqlite_columns_without_rows(engine: Any, source: TableSource) -> list[str] | None:
    """A SQLite ``--query``'s column names from a copy of the database's schema with no row in it (its
    tables' and views' ``CREATE`` statements run in an in-memory database), or None where that copy
    cannot be made (a virtual table's module, say: the caller falls back to ``WHERE 1 = 0``).

    Guarantee: the check sees no stored value, even for a query that closes the check's parenthesis
    (review revG F1), so its error text is shown — it can quote only the query and the schema — and
    whether the check passes, and so whether a job goes on to charge, depends on no record."""
    import sqlite3

    with engine.connect() as conn:
        ddl = [
            str(row[0])
            for row in conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND type IN ('table', 'view') "
                "AND name NOT LIKE 'sqlite_%' ORDER BY type = 'view', rowid"
            )
        ]
    empty = sqlite3.connect(":memory:")
    try:
        try:
            for statement in ddl:
                empty.execute(statement)
        except sqlite3.Error:
            return None
        query = str(source.query).strip().rstrip(";")
        try:
            cursor = empty.execute(f"SELECT * FROM ({query}) AS veil_q WHERE 1 = 0")
        except sqlite3.Error as exc:
            raise DataError(
                "query",
                source.query,
                f"the database refused the query ({first_line(exc)}; checked on its schema without rows)",
                "check its tables and columns against the database's schema",
            ) from None
        return [str(d[0]) for d in cursor.description or ()]
    finally:
        empty.close()


def _partition(names: list[str], rows: Sequence[Sequence[Any]]) -> pa.Table:
    """Rows of a result partition → an Arrow table, column by column: typed where Arrow finds one type
    for a column's cells, else the cells as text (:mod:`~veil.tables.sources.cells`: a rule on each cell,
    so a column of mixed types is read, never refused, and each record reads as it would alone)."""
    import pyarrow as pa

    columns = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    return pa.table({n: mixed_cells_as_text(c) for n, c in zip(names, columns, strict=True)})


def _one_type_per_column(parts: list[pa.Table]) -> list[pa.Table]:
    """Partitions whose types for a column disagree (integers in one, reals or text in another) have
    that column as text in every partition, by the same per-cell rule — never Arrow's promotion,
    which fails on an integer beyond 2**53 beside a real, a value of one record."""
    import pyarrow as pa

    for name in parts[0].column_names:
        kinds = {p.schema.field(name).type for p in parts} - {pa.null()}
        if len(kinds) > 1:
            parts = [
                p.set_column(p.schema.get_field_index(name), name, column_texts(p.column(name)))
                for p in parts
            ]
    return parts


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
    reflected = sqlalchemy.Table(name, sqlalchemy.MetaData(), schema=schema_name or None, autoload_with=conn)
    # The reflected names, without their types: a typed Table makes SQLAlchemy convert every cell after
    # fetching it (a DATETIME column holding other text raised with the cell's value in the message,
    # after the run was charged). Untyped columns pass the driver's values through to the cell rule.
    table = sqlalchemy.table(
        name, *(sqlalchemy.column(c.name) for c in reflected.columns), schema=schema_name or None
    )
    statement = sqlalchemy.select(table)
    return statement.where(sqlalchemy.false()) if limit == 0 else statement
