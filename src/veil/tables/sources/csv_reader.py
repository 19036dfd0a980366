"""The one CSV parser (pyarrow): typed reads for tables, batches for streaming, text cells for loaders.

One physical line is one record by default: a quote left open on a line makes that line malformed
(skipped and counted, the per-record rule below) and never reaches the next line. Were quoted values
allowed to span lines, one record with an unbalanced quote would swallow every later row into one
malformed "row" (revH's H8: one added line removed half a table), so adding or removing one record
would change the data by far more than one record. Multi-line quoted values are read only where the
data owner declares them (``csv_multiline_values = true`` in a schema, ``--csv-multiline-values`` for
a text run; :attr:`TableSource.multiline_values`), accepting that risk for a file whose quoting they
trust. Only ``\n``/``\r`` end a row, so U+0085 (NEL) or U+2028 inside a cell stays in its row. The
delimiter (``,``, ``;`` or tab) is read from the header line alone; the text encoding is declared
(UTF-8 by default, e.g. ``latin-1``), never guessed from the rows. A cell of a
numeric column that is not a number makes the reader read those columns as text (the encoder then
makes such a cell missing: a per-record rule, never a refusal); a row with the wrong field count is
skipped and counted, a byte not valid in the encoding is U+FFFD in its cell. Any other parse error
shows no part of a row (pyarrow's own message quotes the row, which holds private values).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from veil.errors import DataError
from veil.tables.sources.common import RawTable, TableSource, first_line, need

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.schema import TableSchema

__all__ = [
    "CSV_BLOCK_BYTES",
    "header",
    "multiline_values",
    "newline_count",
    "read_batches",
    "read_csv_text",
    "read_table",
]

CSV_BLOCK_BYTES = 1 << 22
"""Bytes pyarrow parses per block when a CSV is streamed (the rows of a block arrive together)."""


def _open_text(p: Path, encoding: str) -> Any:
    """The file as text, a byte not valid in ``encoding`` read as U+FFFD (for the header too: the
    decoder works on blocks, so a later row's stray byte must not fail the header's read; the header
    is then checked for U+FFFD by :func:`header`)."""
    import gzip

    opener: Any = gzip.open if p.name.lower().endswith(".gz") else open
    codec = "utf-8-sig" if encoding in ("utf-8", "utf_8") else encoding
    return opener(p, "rt", encoding=codec, errors="replace", newline="")


class _Utf8Stream(io.RawIOBase):
    """A text file's characters as UTF-8 bytes, for pyarrow (which parses UTF-8 only).

    With ``one_line`` (``delimiter`` given), a data line whose quote is not closed on that line is
    left out and counted in ``dropped[0]`` (the malformed-row rule, on that line alone), so pyarrow
    never carries a quote into the next line (see the module doc)."""

    def __init__(self, text: Any, delimiter: str | None = None, dropped: list[int] | None = None) -> None:
        self._text = text
        self._pending = bytearray()
        self._delimiter = delimiter
        self._dropped = dropped if dropped is not None else [0]
        self._header = True

    def readable(self) -> bool:
        return True

    def _closes(self, lines: list[str]) -> bool:
        """Whether every one of ``lines`` parses as one record of its own (no quote left open)."""
        stripped = (line.rstrip("\r\n") for line in lines)
        reader = csv.reader(stripped, delimiter=self._delimiter or ",", strict=True)
        try:
            return sum(1 for _ in reader) == len(lines)  # a quote left open would merge two lines
        except csv.Error:
            return False

    def _closed_lines(self, lines: list[str]) -> str:
        """``lines`` less each data line whose quote stays open at its end (counted): all the lines
        parsed at once, line by line only when one of them fails."""
        if self._header:  # checked by header(): passed through as it is
            self._header = False
            return lines[0] + self._closed_lines(lines[1:])
        if self._closes(lines):
            return "".join(lines)
        kept = [line for line in lines if '"' not in line or self._closes([line])]
        self._dropped[0] += len(lines) - len(kept)
        return "".join(kept)

    def _read(self) -> str:
        if self._delimiter is None:
            return str(self._text.read(1 << 16))
        lines = self._text.readlines(1 << 16)  # newline="": a line ends at \n, \r or \r\n
        return self._closed_lines(lines) if lines else ""

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while len(self._pending) < len(view):
            chunk = self._read()
            if not chunk:
                break
            self._pending += chunk.encode("utf-8")
        n = min(len(view), len(self._pending))
        view[:n] = self._pending[:n]
        del self._pending[:n]
        return n

    def close(self) -> None:
        self._text.close()
        super().close()


def _decoded(
    p: Path, encoding: str, multiline: bool = False, dropped: list[int] | None = None
) -> io.BufferedReader:
    """The file decoded with its declared encoding, a byte that is not valid there read as U+FFFD (a
    rule on that byte alone: one record's stray byte neither stops the run after reading nor changes
    another record), re-encoded as UTF-8 for pyarrow. The header was checked before (:func:`header`).
    Unless ``multiline`` is declared, a data line whose quote stays open is left out, counted in
    ``dropped[0]`` (one physical line, one record: see the module doc)."""
    delimiter = None if multiline else _delimiter(p, encoding)
    return io.BufferedReader(_Utf8Stream(_open_text(p, encoding), delimiter, dropped), 1 << 20)


def header(p: Path, encoding: str = "utf-8") -> list[str]:
    """The column names, from the file's first physical line alone (the rows are private: a quote left
    open in the header must not carry the parse into them, and the names appear in messages, which
    must never show a row). A header line whose quote is not closed on it is refused."""
    try:
        with _open_text(p, encoding) as fh:
            line = fh.readline().rstrip("\r\n")  # newline="": \n, \r or \r\n ends the line
        header = next(csv.reader([line], delimiter=_delimiter(p, encoding), strict=True), None)
    except (OSError, UnicodeDecodeError) as exc:
        raise _not_decodable(p, encoding, exc) from None
    except csv.Error:
        raise DataError(
            "CSV header",
            str(p),
            "the header line leaves a quote open, so the column names would run into the rows (which "
            "are private and are never shown)",
            "close the quote in the first line, or put each column name on the first line",
        ) from None
    if not header:
        raise DataError(
            "dataset file", str(p), "the CSV has no header row", "add a header naming the columns"
        )
    names = [h.strip() for h in header]
    if any("\ufffd" in n for n in names):  # the header is public: read before any row
        raise _not_decodable(p, encoding, UnicodeDecodeError(encoding, b"", 0, 1, "in the header line"))
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
    p: Path,
    encoding: str,
    names: list[str],
    block_size: int | None = None,
    malformed: list[int] | None = None,
    multiline: bool = False,
) -> dict[str, Any]:
    """pyarrow's read and parse options shared by every CSV read: the header's (stripped) names, the
    declared encoding, the header's delimiter, and newlines inside quoted values only if ``multiline``
    (declared; see the module doc). A row whose
    field count is not the header's is skipped (a per-record rule: after reading, one record's shape
    must not stop the run, nor its line number appear in a message), counted in ``malformed[0]``."""
    import pyarrow.csv as pa_csv

    counter = malformed if malformed is not None else [0]

    def skip(_row: Any) -> str:
        counter[0] += 1
        return "skip"

    read = pa_csv.ReadOptions(
        column_names=names,
        skip_rows=1,
        encoding="utf8",  # the stream `_decoded` gives is UTF-8 whatever the file's encoding
        **({"block_size": block_size} if block_size else {}),
    )
    parse = pa_csv.ParseOptions(
        delimiter=_delimiter(p, encoding), newlines_in_values=multiline, invalid_row_handler=skip
    )
    return {"read_options": read, "parse_options": parse}


def multiline_values(source: TableSource, schema: TableSchema | None) -> bool:
    """Whether the data owner declared that a quoted value may span lines: on the source, or in the
    schema (``csv_multiline_values = true``)."""
    return source.multiline_values or bool(schema is not None and schema.csv_multiline_values)


def newline_count(path: Path, encoding: str = "utf-8") -> int:
    """An upper bound on the file's data rows, by the reader's own rule: the line ends (``\r\n``, a
    lone ``\r``, a lone ``\n``) in the text as the reader decodes it (same codec, a bad byte read as
    U+FFFD), +1 for a last line without one.

    Guarantee: whatever the bytes, no read of the file yields more rows than this (the reader never
    ends a row elsewhere; the header, a blank or a dropped line only make it looser), so a table
    job's preallocation is never too small. Counted on the decoded text, not the bytes: in a codec
    such as cp500 a line end is not the byte ``\n``. A ``\r\n`` split between two blocks counts twice
    (looser, still a bound). The encoder does not rely on it being one either
    (:meth:`veil.tables.encoder.TableEncoder.encode_batches` grows past a bound, never refuses)."""
    count = 0
    with _open_text(path, encoding) as fh:
        for block in iter(lambda: fh.read(1 << 24), ""):
            count += block.count("\n") + block.count("\r") - block.count("\r\n")
    return count + 1


def read_batches(
    path: Path,
    schema: TableSchema,
    wanted: list[str],
    source: TableSource,
    names: list[str],
    *,
    text: Sequence[str] = (),
    numbers_as_text: bool = False,
    already: int = 0,
    malformed_before: int = 0,
) -> Iterator[RawTable]:
    """The CSV block by block. A cell of a numeric column that is not a number stops pyarrow's typed
    reader; the file is then read again from its start with those columns as text, the ``already``
    rows yielded being passed over (counted as data rows, as the typed reader counted them: a row
    count to skip in the file would also count blank lines, and yield some rows twice), and the
    encoder makes such a cell missing (a per-record rule, never a refusal). Rows with the wrong field
    count are skipped by the parser; each batch carries those counted since the previous one
    (``malformed_before``: counted by an earlier pass, which this one parses again)."""
    pa_csv = need("pyarrow.csv", source.describe())
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
    seen = 0  # data rows read in this pass, yielded or passed over
    malformed = [0]  # rows skipped by the parser so far in this pass
    counted = malformed_before
    multiline = multiline_values(source, schema)
    stream = _decoded(path, source.encoding, multiline, malformed)
    try:
        reader = pa_csv.open_csv(
            stream,
            convert_options=convert,
            **_csv_options(path, source.encoding, names, CSV_BLOCK_BYTES, malformed, multiline),
        )
        for batch in reader:
            start = min(max(already - seen, 0), batch.num_rows)
            seen += batch.num_rows
            if batch.num_rows > start:
                new, counted = max(malformed[0] - counted, 0), max(malformed[0], counted)
                yield RawTable(
                    pa.Table.from_batches([batch.slice(start)]),
                    source,
                    first_row=seen - batch.num_rows + start + 2,
                    malformed=new,
                )
    except pa.ArrowInvalid as exc:
        if numbers_as_text or not _conversion_error(exc):
            _csv_error(path, exc)
        retry = True
    else:
        retry = False
    finally:
        stream.close()
    if retry:
        yield from read_batches(
            path,
            schema,
            wanted,
            source,
            names,
            text=text,
            numbers_as_text=True,
            already=max(seen, already),
            malformed_before=counted,
        )


def _conversion_error(exc: BaseException) -> bool:
    """pyarrow could not convert a cell to its column's type (not a malformed row)."""
    return "conversion error" in str(exc)


def _csv_types(schema: TableSchema | None, *, numbers_as_text: bool = False) -> dict[str, Any]:
    """Column types for pyarrow's reader; numeric features as float64, or as text (then converted by
    the encoder, which makes a cell that is not a number missing). float64 either way: a cell read
    straight to float32 and the same cell read as text then parsed (when another row holds a
    non-number) would round differently — one record changing another's value."""
    import pyarrow as pa

    if schema is None:
        return {}
    types: dict[str, Any] = {}
    for c in schema.columns:
        if not c.used:
            continue
        if c.type == "numeric" and c.role == "feature":
            types[c.name] = pa.string() if numbers_as_text else pa.float64()
        elif c.type in ("categorical", "ordinal") or c.role == "target":
            types[c.name] = pa.dictionary(pa.int32(), pa.string())
        else:
            types[c.name] = pa.string()
    return types


def read_table(
    p: Path,
    schema: TableSchema | None,
    wanted: list[str],
    encoding: str = "utf-8",
    names: list[str] | None = None,
    malformed: list[int] | None = None,
    multiline: bool = False,
) -> pa.Table:
    """The whole CSV, typed by the schema; rows with the wrong field count skipped, counted in
    ``malformed[0]``; ``multiline``: quoted values may span lines (declared)."""
    pa_csv = need("pyarrow.csv", f"csv:{p}")
    import pyarrow as pa

    from veil.tables.schema import DEFAULT_MISSING_VALUES

    missing = list(schema.missing_values if schema is not None else DEFAULT_MISSING_VALUES)
    names = names if names is not None else header(p, encoding)
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
            counter = [0]
            with _decoded(p, encoding, multiline, counter) as stream:
                table = pa_csv.read_csv(
                    stream,
                    convert_options=convert,
                    **_csv_options(p, encoding, names, None, counter, multiline),
                )
            if malformed is not None:
                malformed[0] = counter[0]
            return table
        except pa.ArrowInvalid as exc:
            if numbers_as_text or not _conversion_error(exc):
                _csv_error(p, exc)
    raise AssertionError("unreachable")  # pragma: no cover


def read_csv_text(source: TableSource) -> dict[str, list[str]]:
    """A CSV's every cell as written (text, no type inference, no missing-value markers), by column:
    the table reader with all columns read as strings, for loaders that parse cells themselves."""
    if source.kind != "csv":
        raise DataError("dataset", source.describe(), "only a CSV is read as text cells", "pass csv:PATH")
    pa_csv = need("pyarrow.csv", source.describe())
    import pyarrow as pa

    p = Path(source.location)
    names = header(p, source.encoding)
    convert = pa_csv.ConvertOptions(
        column_types={n: pa.string() for n in names},
        null_values=[],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    try:
        with _decoded(p, source.encoding, source.multiline_values) as stream:
            table = pa_csv.read_csv(
                stream,
                convert_options=convert,
                **_csv_options(p, source.encoding, names, multiline=source.multiline_values),
            )
    except pa.ArrowInvalid as exc:
        _csv_error(p, exc)
    return {name: table.column(name).to_pylist() for name in names}


def _csv_error(p: Path, exc: Exception) -> NoReturn:
    """pyarrow's parse error as one line, never its content (pyarrow's own message quotes the row,
    which holds private values). A row with the wrong field count never gets here: the parser skips it
    (`_csv_options`)."""
    message = first_line(exc)
    raise DataError(
        "dataset file",
        str(p),
        f"the CSV cannot be parsed ({message.split(':')[0]}; the parser's detail is not shown: it may "
        "quote a private row)",
        "check the file's quoting and encoding",
    ) from None
