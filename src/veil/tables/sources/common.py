"""What every table source shares: the source's address, a table as read, and the checks before a read.

:class:`TableSource` (``csv:PATH``, ``parquet:PATH`` or ``sql:URL``, parsed by :func:`parse_source`;
``describe()`` never shows a password), :class:`RawTable`, the password rules for database URLs, the
optional-package import (:func:`need`) and the two-way column check against a schema. The readers per
kind (:mod:`~veil.tables.sources.csv_reader`, :mod:`~veil.tables.sources.parquet_reader`,
:mod:`~veil.tables.sources.sql_reader`) import this module; :mod:`veil.tables.sources` dispatches.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from veil.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.schema import TableSchema

__all__ = [
    "RawTable",
    "SourceKind",
    "TableSource",
    "check_columns",
    "first_line",
    "hide_password",
    "need",
    "parse_source",
    "refuse_password_in_url",
    "url_has_password",
]

SourceKind = Literal["csv", "parquet", "sql"]


@dataclass(frozen=True)
class TableSource:
    """Where a table lives; ``describe()`` is safe to print (no password)."""

    kind: SourceKind
    location: str
    table: str | None = None
    query: str | None = None
    encoding: str = "utf-8"  # of a CSV file: declared, never guessed
    multiline_values: bool = False
    """A CSV's quoted value may span lines (declared; :mod:`veil.tables.sources.csv_reader`)."""

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
    malformed: int = 0
    """Rows of the source the parser skipped before this batch's last row (a CSV row whose field count
    is not the header's): counted by the encoder as ``rows_dropped_malformed``."""

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


def need(module: str, what: str) -> Any:
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


def parse_source(
    spec: str,
    *,
    table: str | None = None,
    query: str | None = None,
    encoding: str = "utf-8",
    multiline_values: bool = False,
) -> TableSource:
    """``csv:PATH`` | ``parquet:PATH`` | ``sql:URL`` (with ``table`` or ``query``) | a .csv/.parquet path.

    ``encoding``: the text encoding of a CSV file (a Python codec name: ``utf-8``, ``latin-1``, ...).
    ``multiline_values``: a CSV's quoted value may span lines (declared; default one line, one record)."""
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
    return TableSource(
        chosen, str(p), encoding=_check_encoding(encoding), multiline_values=bool(multiline_values)
    )


def _check_encoding(encoding: str) -> str:
    import codecs

    try:
        name = codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise DataError(
            "encoding", encoding, "the CSV's text encoding must be a known codec", "pass utf-8 or latin-1"
        ) from None
    if name.startswith(_UNSYNCHRONISED):
        raise DataError(
            "encoding",
            encoding,
            "after one bad byte this codec can read every later row into one cell (it does not find the "
            "next line on its own), so one record would decide the others",
            "convert the file to UTF-8 (or a one-byte encoding such as latin-1) and declare that",
        )
    return name


_UNSYNCHRONISED = ("utf-16", "utf-32", "utf-7", "iso2022")
"""Codecs (by ``codecs.lookup`` name prefix) whose decoding of a line depends on the bytes before it:
refused before the file is read."""


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
