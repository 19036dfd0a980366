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

__all__ = ["SQL_PARTITION_ROWS", "read_table", "refuse_query_without_check"]

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


#: The one message of any failure of a read statement that can evaluate rows (the full read, a
#: table's column check under ``WHERE false``, SQLite's fallback check under ``WHERE 1 = 0``, at
#: ``execute`` or while fetching): the database's own text is never shown, as it can quote a stored
#: value. A ``--query`` is the user's SQL: text that closes a check's parenthesis runs a SELECT over
#: the rows outside ``WHERE 1 = 0`` (review revG F1), and a table name can be a view the database
#: evaluates (MySQL materializes some before the ``WHERE``).
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


def read_table(
    source: TableSource, limit: int | None = None, columns: Sequence[str] | None = None
) -> pa.Table:
    """Run the table read or query; ``limit=0`` fetches the column names only.

    ``columns`` (a ``--table`` read): select only these columns (the schema's declared ones, checked
    present before), as quoted identifiers, so a column veil will not use is never computed — an
    undeclared generated column evaluates an expression per row and can fail on one stored value
    (revK K4), after the run was charged. None: every reflected column (no schema declared).

    ``limit=0`` on a ``--query`` evaluates no row: on SQLite the query runs on a copy of the schema
    without rows (:func:`_sqlite_columns_without_rows`), on PostgreSQL the server describes it without
    running it (:func:`_postgres_columns_unexecuted`); a ``--query`` on any other database (or driver)
    is refused before connecting (:func:`refuse_query_without_check`). A table's check runs
    ``SELECT`` of its reflected columns under ``WHERE false``. :func:`veil.tables.sources.read_source`
    runs the check before every full read.
    Guarantee: the database's own error text is never shown for a statement that runs over the rows,
    the full read or a table's check, at ``execute`` or while fetching: any failure is one fixed
    message, :func:`_read_failed`, whatever statement, record or place caused it. The text can quote a
    stored value (PostgreSQL's ``invalid input syntax for type integer: "<value>"``, SQLite's ``JSON
    path error near '<value>'``). A failure over the rows cannot become a per-record rule, as the
    database computes the query: the caller's reservation is kept, nothing released. The query
    checks that evaluate no row show the database's text (it quotes only the query and the schema),
    and connection errors keep theirs (host, port, database: no stored value)."""
    import pyarrow as pa

    sqlalchemy = need("sqlalchemy", source.describe())
    from sqlalchemy import exc as sa_exc

    if source.query is not None:
        refuse_query_without_check(source)
    engine = _engine(source)
    if limit == 0 and source.query is not None and engine.dialect.name == "postgresql":
        try:
            names = _postgres_columns_unexecuted(engine, source)
        finally:
            engine.dispose()
        _check_unique(names)
        return pa.table({n: pa.array([], pa.null()) for n in names})
    if limit == 0 and source.query is not None and engine.dialect.name == "sqlite":
        try:
            sqlite_names = _sqlite_columns_without_rows(engine, source)
        finally:
            engine.dispose()
        if sqlite_names is not None:
            _check_unique(sqlite_names)
            return pa.table({n: pa.array([], pa.null()) for n in sqlite_names})
        engine = _engine(source)  # the fallback check below, on a fresh engine
    if limit == 0 and source.query is None and engine.dialect.name == "sqlite":
        try:
            names = _sqlite_table_columns(engine, source)
        finally:
            engine.dispose()
        _check_unique(names)
        return pa.table({n: pa.array([], pa.null()) for n in names})
    try:
        try:
            conn = engine.connect()
        except sa_exc.SQLAlchemyError as exc:
            raise _connect_error(source, exc) from None
        with conn:
            statement = _statement(sqlalchemy, conn, source, limit, columns)
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


def _sqlite_columns_without_rows(
    engine: Any, source: TableSource, skip_failing: bool = False
) -> list[str] | None:
    """A SQLite ``--query``'s column names from a copy of the database's schema with no row in it (its
    tables' and views' ``CREATE`` statements run in an in-memory database), or None where that copy
    cannot be made (a virtual table's module, say: the caller falls back to ``WHERE 1 = 0``).
    ``skip_failing``: a statement the copy refuses is left out instead (a virtual table's shadow
    tables, which its ``CREATE VIRTUAL TABLE`` already made; a module not loaded here), and the query
    runs on what was copied.

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
        for statement in ddl:
            try:
                empty.execute(statement)
            except sqlite3.Error:
                if not skip_failing:
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


def _sqlite_table_columns(engine: Any, source: TableSource) -> list[str]:
    """A SQLite ``--table``'s column names from the schema alone: ``sqlite_master`` says what the name
    is; a plain table's columns come from ``PRAGMA table_info`` (its declaration), a view's from a
    copy of the database's schema with no row in it (:func:`_sqlite_columns_without_rows`: the view's
    query runs there, over empty tables; a view the copy cannot run, over a module not loaded here,
    is refused with the database's text, which quotes only the schema). A virtual table is refused:
    its rows are made by its module's code, which describing it already runs (``xConnect``,
    ``xBestIndex``) and which may read any data source (FTS5 reads its shadow tables), so no check
    of it can promise to touch no stored value; its rows copied into a plain table are read like any
    other.

    Guarantee: no statement of this check runs over a stored row, so whether it passes (and so
    whether a job goes on to charge) depends on the schema alone, never on a record."""
    schema_name, _, name = str(source.table).rpartition(".")
    prefix = f"{_quoted(schema_name)}." if schema_name else ""
    try:
        conn = engine.connect()
    except Exception as exc:
        raise _connect_error(source, exc) from None
    with conn:
        entries = {
            str(row[0]): (str(row[1]), str(row[2] or ""))
            for row in conn.exec_driver_sql(
                f"SELECT name, type, sql FROM {prefix}sqlite_master WHERE type IN ('table', 'view') "
                "AND name NOT LIKE 'sqlite_%'"
            )
        }
        if name not in entries:
            close = difflib.get_close_matches(name, list(entries), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise DataError(
                "table",
                source.table,
                "the database has no such table",
                f"{hint}tables there: {', '.join(sorted(entries)[:15]) or 'none'}",
            )
        kind, ddl = entries[name]
        if kind == "table" and ddl.lstrip().upper().startswith("CREATE VIRTUAL TABLE"):
            raise DataError(
                "table",
                source.table,
                "it is a virtual table: its rows are made by its module's code, which even describing "
                "its columns runs, so a check of it could depend on the stored data",
                f"copy its rows into a plain table (CREATE TABLE {name}_rows AS SELECT * FROM {name}) and "
                "pass --table with that table",
            )
        if kind == "table":
            pragma = f"PRAGMA {prefix}table_info({_quoted(name)})"
            return [str(row[1]) for row in conn.exec_driver_sql(pragma)]
    view = TableSource(kind=source.kind, location=source.location, query=f"SELECT * FROM {_quoted(name)}")
    names = _sqlite_columns_without_rows(engine, view, skip_failing=True)
    assert names is not None  # skip_failing: the copy is always made
    return names


def _quoted(identifier: str) -> str:
    """A SQLite identifier in double quotes (inner quotes doubled)."""
    return '"' + identifier.replace('"', '""') + '"'


_QUERY_DIALECTS = {"sqlite": None, "postgresql": "psycopg"}
"""The databases (and, where it matters, the driver) whose ``--query`` column check evaluates no row:
SQLite (:func:`_sqlite_columns_without_rows`), PostgreSQL through psycopg 3
(:func:`_postgres_columns_unexecuted`: libpq's describe, which other drivers do not offer)."""


def refuse_query_without_check(source: TableSource) -> None:
    """Refuse a ``--query`` on a database whose column check could evaluate rows, before connecting.

    Guarantee: the refusal depends on the URL alone (its dialect and driver, public), so it is the
    same for every database content; elsewhere a check under ``WHERE 1 = 0`` could run a SELECT over
    the rows (a query that closes its parenthesis), and whether it passed — and so whether a job goes
    on to charge — could depend on one record. A URL SQLAlchemy cannot parse is left to
    :func:`_engine`, which refuses it with its own message. Jobs run it before the charge
    (:func:`veil.data.check_request`); :func:`read_table` runs it again before connecting."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(source.location)
        backend, driver = url.get_backend_name(), url.get_driver_name()
    except Exception:
        return
    if backend in _QUERY_DIALECTS and _QUERY_DIALECTS[backend] in (None, driver):
        return
    use = "postgresql+psycopg://" if backend == "postgresql" else "SQLite or postgresql+psycopg://"
    raise DataError(
        "query",
        source.query,
        f"a --query on {backend}+{driver} cannot have its columns checked without running it over the rows "
        "(whether the check passed could depend on one record)",
        f"read a table or a view with --table instead, or use {use} (see docs/tables.md)",
    )


def _postgres_columns_unexecuted(engine: Any, source: TableSource) -> list[str]:
    """A PostgreSQL ``--query``'s column names from the server's description of it, never executed.

    On SQLAlchemy's connection, through its psycopg 3 connection's libpq (``PQprepare`` then
    ``PQdescribePrepared``): the server parses, analyzes and rewrites the statement (names, types,
    views expanded) but neither plans nor runs it. The query alone must be one statement (libpq
    refuses a prepared statement of several) that returns rows, and it must read as a subquery
    (``SELECT * FROM (query) AS veil_q``, also only described): a SELECT, as the full read expects,
    never a statement that writes. The statement is deallocated and the connection closed after.

    Guarantee: the check evaluates no row, even for a query that closes the wrapper's parenthesis, so
    its error text is shown (it can quote only the query and the schema) and whether it passes, and
    so whether a job goes on to charge, depends on no record."""
    from sqlalchemy import exc as sa_exc

    query = str(source.query).strip()
    try:
        conn = engine.connect()
    except sa_exc.SQLAlchemyError as exc:
        raise _connect_error(source, exc) from None
    with conn:
        dbapi = conn.connection.dbapi_connection
        names = _describe(dbapi, source, query)
        _describe(dbapi, source, f"SELECT * FROM ({query.rstrip(';')}) AS veil_q")  # a SELECT
    if not names:
        raise DataError(
            "query",
            source.query,
            "the statement returns no rows (checked without running it)",
            "write one SELECT statement",
        )
    return names


def _describe(dbapi: Any, source: TableSource, text: str) -> list[str]:
    """The result columns of ``text`` as the server describes it (prepared, described, deallocated:
    never executed); a statement the server refuses is :class:`DataError` with its text."""
    from psycopg import pq

    pgconn, encoding = dbapi.pgconn, dbapi.info.encoding
    prepared = pgconn.prepare(b"veil_check", text.encode(encoding))
    if prepared.status != pq.ExecStatus.COMMAND_OK:
        message = prepared.error_message.decode(encoding, "replace").removeprefix("ERROR:")
        why = next(iter(message.strip().splitlines()), "no reason given")
        raise DataError(
            "query",
            source.query,
            f"the database refused the query ({why}; checked without running it)",
            "write one SELECT statement, and check its tables and columns against the database's schema",
        )
    try:
        described = pgconn.describe_prepared(b"veil_check")
        return [described.fname(i).decode(encoding) for i in range(described.nfields)]
    finally:
        pgconn.exec_(b"DEALLOCATE veil_check")


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


def _statement(
    sqlalchemy: Any, conn: Any, source: TableSource, limit: int | None, columns: Sequence[str] | None = None
) -> Any:
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
    # Only the requested columns when given (each name quoted as stored): a column left out is never
    # computed by the database, so an undeclared generated column cannot fail the read on one row.
    names = [c.name for c in reflected.columns] if columns is None else list(columns)
    table = sqlalchemy.table(
        name,
        *(sqlalchemy.column(sqlalchemy.sql.quoted_name(c, quote=True)) for c in names),
        schema=schema_name or None,
    )
    statement = sqlalchemy.select(table)
    return statement.where(sqlalchemy.false()) if limit == 0 else statement
