"""One CSV reader (pyarrow) for tables and texts: cells with line-like characters stay in their row.

A valid CSV may hold, inside quoted cells, a newline, U+0085 (NEL, byte 0x85 in Latin-1) or U+2028
(LINE SEPARATOR): ``str.splitlines()`` cuts rows at all three. The text loader's reader
(``veil.data.tabular.read_csv_columns``, what ``veil train --dataset csv:... --text-column`` uses) and
the table reader (``veil.tables.sources.read_source``) must both read every cell as Python's ``csv``
module does on the file opened with ``newline=""`` (the independent reference), in UTF-8 and Latin-1,
once the data owner declares that quoted values may span lines. By default one physical line is one
record: an unbalanced quote makes only its own line malformed (revH's H8).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from veil.data.tabular import read_csv_columns
from veil.errors import DataError
from veil.tables.sources import parse_source, read_source

TEXTS = [
    "a quoted\nnewline",
    "a next-line\x85character",
    'quotes "inside", and a comma',
    "crlf\r\ninside",
    "plain café",
]


def _write(tmp_path: Path, encoding: str, delimiter: str = ",") -> tuple[Path, dict[str, list[str]]]:
    texts = [*TEXTS, "a line\u2028separator"] if encoding == "utf-8" else TEXTS
    rows = [[t, "pos" if i % 2 else "neg", str(i)] for i, t in enumerate(texts * 3)]
    p = tmp_path / f"texts-{encoding}.csv"
    with p.open("w", newline="", encoding=encoding) as fh:
        writer = csv.writer(fh, delimiter=delimiter)
        writer.writerow(["text", "label", "id"])
        writer.writerows(rows)
    with p.open(newline="", encoding=encoding) as fh:  # the reference: Python's csv module
        header, *body = list(csv.reader(fh, delimiter=delimiter))
    expected = {name: [r[j] for r in body] for j, name in enumerate(header)}
    assert len(body) == len(rows) and expected["text"] == [r[0] for r in rows]
    return p, expected


def test_utf8_text_path_reads_every_cell_in_its_row(tmp_path: Path) -> None:
    p, expected = _write(tmp_path, "utf-8")
    assert read_csv_columns(p, multiline_values=True) == expected


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_the_table_and_text_paths_read_the_same_cells(tmp_path: Path, encoding: str) -> None:
    p, expected = _write(tmp_path, encoding)
    text_path = read_csv_columns(p, encoding=encoding, multiline_values=True)
    table = read_source(parse_source(f"csv:{p}", encoding=encoding, multiline_values=True)).table
    table_path = {name: [str(v) for v in table.column(name).to_pylist()] for name in table.column_names}
    assert text_path == expected
    assert table_path == expected


def test_a_semicolon_csv_is_still_read(tmp_path: Path) -> None:
    p, expected = _write(tmp_path, "utf-8", delimiter=";")
    assert read_csv_columns(p, multiline_values=True) == expected


def test_latin1_bytes_read_as_utf8_become_replacement_characters_in_their_cells(tmp_path: Path) -> None:
    """A byte not valid in the declared encoding is U+FFFD in its own cell (a rule on that byte): it
    was a refusal of the whole file after reading, decided by one record's bytes."""
    p, expected = _write(tmp_path, "latin-1")
    got = read_csv_columns(p, multiline_values=True)
    assert got["label"] == expected["label"] and got["id"] == expected["id"]
    assert got["text"] == [t.replace("\x85", "\ufffd").replace("é", "\ufffd") for t in expected["text"]]


def test_a_header_not_valid_in_the_declared_encoding_is_refused(tmp_path: Path) -> None:
    """The header is read before any row (public): a name that does not decode is still refused."""
    p = tmp_path / "h.csv"
    p.write_bytes("café,y\n1,0\n".encode("latin-1"))
    with pytest.raises(DataError, match="encoding"):
        read_csv_columns(p)


def _open_quote_file(tmp_path: Path) -> tuple[Path, list[str]]:
    """100 rows; row 40 opens a quote it never closes."""
    rows = [f"{i / 10},t{i},{i % 2}" for i in range(100)]
    rows.insert(40, '0.5,"SSN-123-45-6789,1')
    p = tmp_path / "q.csv"
    p.write_text("a,b,y\n" + "\n".join(rows) + "\n")
    return p, rows


def test_an_unclosed_quote_makes_only_its_own_line_malformed(tmp_path: Path) -> None:
    """revH's H8: by default one physical line is one record, on the text path and the table path
    (typed by a schema, and streamed): the open quote's line is dropped as malformed, every other
    row is read. Declared multi-line values bring back the risk: the rest of the file is one row."""
    from veil.tables.schema import parse_schema
    from veil.tables.sources import iter_source

    p, _ = _open_quote_file(tmp_path)
    text = read_csv_columns(p)
    assert len(text["a"]) == 100 and "SSN-123-45-6789" not in "".join(text["b"])
    raw = read_source(parse_source(f"csv:{p}"))
    assert raw.table.num_rows == 100 and raw.malformed == 1
    columns = {"a": {"type": "numeric", "bounds": [0, 10]}, "b": {"type": "text"}}
    schema = parse_schema(
        {"reviewed": True, "columns": {**columns, "y": {"role": "target", "classes": ["0", "1"]}}}
    )
    raw = read_source(parse_source(f"csv:{p}"), schema)
    assert raw.table.num_rows == 100 and raw.malformed == 1
    _, batches = iter_source(parse_source(f"csv:{p}"), schema)
    assert sum(b.table.num_rows for b in batches) == 100
    # Declared: the quote runs to the end of the file (the risk the declaration accepts).
    declared = read_source(parse_source(f"csv:{p}", multiline_values=True)).table.num_rows
    assert declared == 40
    multiline = parse_schema(
        {
            "reviewed": True,
            "csv_multiline_values": True,
            "columns": {**columns, "y": {"role": "target", "classes": ["0", "1"]}},
        }
    )
    assert read_source(parse_source(f"csv:{p}"), multiline).table.num_rows == 40
