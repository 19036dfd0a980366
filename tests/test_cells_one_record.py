"""Each record's cells are read and encoded by a rule on the cell alone (veil.tables.sources.cells).

After a private row is read nothing may depend on one other record: a SQLite column whose cells hold
values of several types is read (it stopped the run with Arrow's type error, after the charge), and
a float cell's text does not depend on whether the other cells are integral.
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
sqlalchemy = pytest.importorskip("sqlalchemy")

from veil.tables import load_table  # noqa: E402
from veil.tables.schema import parse_schema  # noqa: E402
from veil.tables.sources import sql_reader  # noqa: E402
from veil.tables.sources.cells import (  # noqa: E402
    cell_text,
    column_texts,
    mixed_cells_as_text,
    number_text,
    number_texts,
)

SCHEMA = parse_schema(
    {
        "reviewed": True,
        "columns": {
            "dose": {"type": "numeric", "bounds": [0, 100]},
            "site": {"type": "categorical", "levels": ["3", "2.5", "north"]},
            "y": {"role": "target", "classes": ["0", "1"]},
        },
    },
    "test",
)

# SQLite keeps a type per cell: integers, reals and text in one column.
ROWS = [
    (7, 3, 0),
    (2.5, 2.5, 1),
    ("12", "north", 0),
    ("not a number", 3.0, 1),
    (None, "south", 0),
    (40, 3, 1),
    (True, b"north", 0),  # bytes beside text: Arrow alone would read "north" as bytes
    (2**53 + 77, "north", 1),  # an integer no double holds, beside reals
]


@pytest.fixture
def mixed_db(tmp_path: Path) -> str:
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'mixed.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (dose, site, y)")  # no declared types: a type per cell
        conn.exec_driver_sql("INSERT INTO t VALUES (?, ?, ?)", ROWS)
    engine.dispose()
    return f"sql:sqlite:///{tmp_path / 'mixed.db'}"


def _encode(url: str, query: str) -> tuple[np.ndarray, np.ndarray]:
    enc = load_table(url, SCHEMA, query=query)
    return enc.x, enc.y


def test_a_mixed_type_column_is_read_and_each_row_encodes_as_it_would_alone(mixed_db: str) -> None:
    x, y = _encode(mixed_db, "SELECT dose, site, y FROM t ORDER BY rowid")
    assert len(x) == len(ROWS)
    for i in range(len(ROWS)):
        xi, yi = _encode(mixed_db, f"SELECT dose, site, y FROM t WHERE rowid = {i + 1}")
        np.testing.assert_array_equal(xi[0], x[i], err_msg=f"row {i + 1} read alone differs")
        assert yi[0] == y[i]
    # The integer 3, the real 3.0 and the text "3" are one level.
    names = load_table(mixed_db, SCHEMA, query="SELECT dose, site, y FROM t").feature_names
    site = [i for i, n in enumerate(names) if n.startswith("site")]
    np.testing.assert_array_equal(x[0, site], x[3, site])
    np.testing.assert_array_equal(x[0, site], x[5, site])
    assert not np.array_equal(x[0, site], x[1, site])


def test_partitions_of_different_types_are_joined_as_text(mixed_db: str, monkeypatch) -> None:
    monkeypatch.setattr(sql_reader, "SQL_PARTITION_ROWS", 2)  # ints, reals, text, a 2**53+77: types differ
    x, _ = _encode(mixed_db, "SELECT dose, site, y FROM t ORDER BY rowid")
    monkeypatch.setattr(sql_reader, "SQL_PARTITION_ROWS", 65_536)
    whole, _ = _encode(mixed_db, "SELECT dose, site, y FROM t ORDER BY rowid")
    np.testing.assert_array_equal(x, whole)


def test_a_float_cell_reads_the_same_whatever_the_other_cells_hold() -> None:
    """3.0 is "3" beside 2.5 as it is beside 4.0 (it was "3.0" as soon as one cell was not integral)."""
    schema = parse_schema(
        {"reviewed": True, "columns": {"c": {"type": "categorical", "levels": ["3", "2.5"]}}}, "test"
    )
    from veil.tables.encoder import TableEncoder
    from veil.tables.sources import RawTable
    from veil.tables.sources.common import TableSource

    def codes(values: list[float]) -> np.ndarray:
        raw = RawTable(pa.table({"c": pa.array(values, pa.float64())}), TableSource("csv", "x.csv"))
        return TableEncoder(schema).encode(raw, with_target=False).x

    together = codes([3.0, 2.5])
    np.testing.assert_array_equal(together[0], codes([3.0, 4.0])[0])
    np.testing.assert_array_equal(together[1], codes([2.5])[0])


def _numeric_and_label(column: str, low: float, high: float):  # type: ignore[no-untyped-def]
    """A reviewed schema: one numeric feature within ``[low, high]`` and a 0/1 label ``y``."""
    return parse_schema(
        {
            "reviewed": True,
            "columns": {
                column: {"type": "numeric", "bounds": [low, high]},
                "y": {"role": "target", "classes": ["0", "1"]},
            },
        },
        "test",
    )


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.lists(st.one_of(finite, st.none(), st.just(math.nan)), max_size=40))
def test_number_texts_is_number_text_cell_by_cell(values: list[float | None]) -> None:
    got = number_texts(pa.array(values, pa.float64(), from_pandas=False)).to_pylist()
    assert got == [None if v is None else number_text(v) for v in values]


_DAY = datetime.timedelta(hours=23)
_cells = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.dates(),
    st.datetimes(),
    st.datetimes(timezones=st.builds(datetime.timezone, st.timedeltas(-_DAY / 2, _DAY / 2))),
    st.decimals(places=2, min_value=-1000, max_value=1000),
    st.dictionaries(st.text(max_size=2), st.one_of(st.integers(), st.floats(), st.none()), max_size=3),
    st.lists(st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats()), max_size=3),
)


@given(st.lists(_cells, max_size=6))
def test_each_cell_reads_as_it_would_alone_whatever_its_neighbours(cells: list[object]) -> None:
    """mixed_cells_as_text then column_texts gives each cell the text cell_text gives it alone."""
    column = pa.chunked_array([mixed_cells_as_text(cells)])
    assert column_texts(column).to_pylist() == [cell_text(v) for v in cells]


@given(finite)
def test_a_number_text_reads_back_as_the_same_number(v: float) -> None:
    text = number_text(v)
    assert text is not None and float(text) == v


def test_cell_rules_for_other_types() -> None:
    import decimal

    assert [cell_text(v) for v in (True, 3, 3.0, decimal.Decimal("2.50"), b"\xff7", None)] == [
        "true", "3", "3", "2.5", "ff37", None,
    ]  # fmt: skip
    assert cell_text(datetime.date(2020, 1, 2)) == "2020-01-02"
    stamps = pa.chunked_array([pa.array([datetime.datetime(2020, 1, 2, 3, 4)])])
    assert column_texts(stamps).to_pylist() == [cell_text(datetime.datetime(2020, 1, 2, 3, 4))]
    assert [cell_text(v) for v in ({"b": [1, 2.5], "a": None}, [1, "x"], ())] == [
        '{"a":null,"b":[1,2.5]}', '[1,"x"]', "[]",
    ]  # fmt: skip


def test_json_and_zoned_cells_read_as_they_would_alone() -> None:
    """Arrow types a column of objects as one struct (every record gets every key), lists of integers
    as reals beside a real and timestamps in the first record's zone; read cell by cell instead."""
    east = datetime.timezone(datetime.timedelta(hours=2))
    for cells in (
        [{"a": 1}, {"b": 2}],
        [[1, 2], [1.5]],
        [datetime.datetime(2020, 1, 1, 12, tzinfo=tz) for tz in (datetime.timezone.utc, east)],
    ):
        column = pa.chunked_array([mixed_cells_as_text(cells)])
        assert column_texts(column).to_pylist() == [cell_text(v) for v in cells]
        assert [column_texts(pa.chunked_array([mixed_cells_as_text([v])])).to_pylist()[0] for v in cells] == [
            cell_text(v) for v in cells
        ]


def test_an_integer_no_double_holds_beside_reals_in_another_partition(tmp_path: Path, monkeypatch) -> None:
    """Integers in one partition, reals in the next: Arrow's promotion failed on 2**53 + 77 (a value
    of one record, printed in the traceback, after the charge); the column is read as text instead."""
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'big.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (dose, site, y)")
        conn.exec_driver_sql(
            "INSERT INTO t VALUES (?, ?, ?)",
            [(2**53 + 77, "3", 0), (5, "3", 1), (2.5, "north", 0), (1.5, "3", 1)],
        )
    engine.dispose()
    url = f"sql:sqlite:///{tmp_path / 'big.db'}"
    monkeypatch.setattr(sql_reader, "SQL_PARTITION_ROWS", 2)
    x, _ = _encode(url, "SELECT dose, site, y FROM t ORDER BY rowid")
    for i in range(4):
        xi, _ = _encode(url, f"SELECT dose, site, y FROM t WHERE rowid = {i + 1}")
        np.testing.assert_array_equal(xi[0], x[i])


def test_a_missing_label_does_not_change_the_other_labels() -> None:
    """A column of integer labels with one missing cell arrives as reals (1.0): each label is still
    read alone ("1"), where it became "1.0", undeclared, for every row (found on SQL text data)."""
    from veil.data import encode_labels

    alone, _ = encode_labels(np.array([1, 0, 1]), "y", ["0", "1"])
    beside_a_missing, _ = encode_labels(np.array([1.0, 0.0, 1.0, np.nan]), "y", ["0", "1"])
    np.testing.assert_array_equal(beside_a_missing[:3], alone)
    assert beside_a_missing[3] < 0
    declared_as_reals, _ = encode_labels(np.array([1.0, 0.0]), "y", ["0.0", "1.0"])
    np.testing.assert_array_equal(declared_as_reals, [1, 0])


def test_a_csv_number_reads_the_same_beside_a_cell_that_is_not_one(tmp_path: Path) -> None:
    """A non-number elsewhere in the column makes the reader parse that column as text; the value of
    every other cell is unchanged (it was read to float32 directly, or through float64 from text:
    two roundings that differ for this value, found by the review)."""
    schema = _numeric_and_label("v", 0, 2)
    value = "1.00000005960464477539062500000000001"
    alone, beside = tmp_path / "alone.csv", tmp_path / "beside.csv"
    alone.write_text(f"v,y\n{value},1\n0.5,0\n")
    beside.write_text(f"v,y\n{value},1\n0.5,0\nabc,1\n")
    a = load_table(f"csv:{alone}", schema).x
    b = load_table(f"csv:{beside}", schema).x
    np.testing.assert_array_equal(b[:2], a)


def test_a_declared_column_type_never_converts_a_cell_after_reading(tmp_path: Path) -> None:
    """Review: ``--table`` reflected the declared column types and SQLAlchemy converted every fetched
    cell by them: a DATETIME, NUMERIC or JSON column holding other text raised after the charge, with
    the cell's value in the message. The table is read untyped, each cell by the cell rule."""
    from veil.tables.sources.common import TableSource

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'typed.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (seen DATETIME, dose NUMERIC, doc JSON, y INTEGER)")
        conn.exec_driver_sql(
            "INSERT INTO t VALUES (?, ?, ?, ?)",
            [("2020-01-02 03:04:05", 2.5, '{"a": 1}', 0), ("SECRET-ssn-123", "n/a", "{not json", 1)],
        )
    engine.dispose()
    url = f"sqlite:///{tmp_path / 'typed.db'}"
    rows = sql_reader.read_table(TableSource("sql", url, table="t")).to_pylist()
    assert rows[1] == {"seen": "SECRET-ssn-123", "dose": "n/a", "doc": "{not json", "y": 1}
    assert rows[0]["seen"] == "2020-01-02 03:04:05" and rows[0]["doc"] == '{"a": 1}'


def test_a_driver_error_while_fetching_shows_no_value(tmp_path: Path, monkeypatch) -> None:
    """The backstop: any error while fetching rows becomes one line without the driver's text."""
    from veil.errors import DataError
    from veil.tables.sources.common import TableSource

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (a)")
        conn.exec_driver_sql("INSERT INTO t VALUES ('SECRET')")
    engine.dispose()

    def boom(names, rows):  # type: ignore[no-untyped-def]
        raise ValueError(f"Invalid isoformat string: {rows[0][0]!r}")

    monkeypatch.setattr(sql_reader, "_partition", boom)
    with pytest.raises(DataError) as caught:
        sql_reader.read_table(TableSource("sql", f"sqlite:///{tmp_path / 'x.db'}", table="t"))
    assert "SECRET" not in str(caught.value) and "not shown" in str(caught.value)


def test_a_streamed_csv_with_blank_lines_reads_each_row_once_whatever_a_later_cell_holds(
    tmp_path: Path, monkeypatch
) -> None:
    """Review: a cell that is not a number in a later block made the streaming reader reopen the file
    skipping the rows already yielded — a count pyarrow also spent on blank lines, so rows after them
    were yielded twice: one record decided how often others were trained on. Each row now once."""
    from veil.tables.sources import csv_reader, iter_source, parse_source

    schema = _numeric_and_label("a", 0, 1000)
    monkeypatch.setattr(csv_reader, "CSV_BLOCK_BYTES", 256)  # many blocks from a small file

    def rows(last: str) -> list[tuple[object, object]]:
        path = tmp_path / f"t{last}.csv"
        body = "".join(f"{i},{i % 2}\n" + ("\n" if i in (3, 5, 9) else "") for i in range(5000))
        path.write_text("a,y\n" + body + f"{last},1\n")
        _, batches = iter_source(parse_source(f"csv:{path}"), schema)
        out = []
        for raw in batches:
            out += list(
                zip(raw.table.column("a").to_pylist(), raw.table.column("y").to_pylist(), strict=True)
            )
        return out

    clean, odd = rows("7"), rows("oops")
    assert len(clean) == len(odd) == 5001
    assert [str(float(a)) for a, _ in odd[:5000]] == [str(float(a)) for a, _ in clean[:5000]]


def test_a_row_with_the_wrong_field_count_is_dropped_and_counted_not_refused(tmp_path: Path) -> None:
    """Review: one row with an extra field stopped a charged run (exit 2, its line number and field
    count in the message). It is skipped by a per-record rule now, counted as rows_dropped_malformed;
    every other row encodes as it would without it, in memory and streamed."""
    from veil.tables.encoder import TableEncoder
    from veil.tables.sources import iter_source, parse_source, read_source

    schema = _numeric_and_label("a", 0, 100)
    rows = [f"{i},{i % 2}\n" for i in range(40)]
    clean, odd = tmp_path / "clean.csv", tmp_path / "odd.csv"
    clean.write_text("a,y\n" + "".join(rows))
    odd.write_text("a,y\n" + "".join(rows[:20]) + "5,1,SECRET\n" + "".join(rows[20:]))
    encoder = TableEncoder(schema)
    want = encoder.encode(read_source(parse_source(f"csv:{clean}"), schema))
    got = encoder.encode(read_source(parse_source(f"csv:{odd}"), schema))
    np.testing.assert_array_equal(got.x, want.x)
    assert got.rules["rows_dropped_malformed"] == 1 and want.rules["rows_dropped_malformed"] == 0
    bound, batches = iter_source(parse_source(f"csv:{odd}"), schema)
    streamed = encoder.encode_batches(bound, batches)
    np.testing.assert_array_equal(streamed.x, want.x)
    assert streamed.rules["rows_dropped_malformed"] == 1


def test_a_byte_not_valid_in_the_declared_encoding_is_replaced_in_its_cell_only(tmp_path: Path) -> None:
    """Review: one byte that is not UTF-8 in a text cell stopped a charged run ("cannot be read as
    utf-8"). It reads as U+FFFD in its own cell; every other row reads as it would without it."""
    from veil.tables.encoder import TableEncoder
    from veil.tables.sources import iter_source, parse_source, read_source

    schema = parse_schema(
        {
            "reviewed": True,
            "columns": {
                "c": {"type": "categorical", "levels": ["a", "b"]},
                "y": {"role": "target", "classes": ["0", "1"]},
            },
        },
        "test",
    )
    rows = [f"{'ab'[i % 2]},{i % 2}\n".encode() for i in range(30)]
    clean, odd = tmp_path / "clean.csv", tmp_path / "odd.csv"
    clean.write_bytes(b"c,y\n" + b"".join(rows))
    odd.write_bytes(b"c,y\n" + b"".join(rows[:10]) + b"caf\xe9,1\n" + b"".join(rows[10:]))
    encoder = TableEncoder(schema)
    want = encoder.encode(read_source(parse_source(f"csv:{clean}"), schema), drop=False)
    raw = read_source(parse_source(f"csv:{odd}"), schema)
    assert raw.table.column("c").to_pylist()[10] == "caf\ufffd"
    got = encoder.encode(raw, drop=False)
    np.testing.assert_array_equal(np.delete(got.x, 10, axis=0), want.x)
    bound, batches = iter_source(parse_source(f"csv:{odd}"), schema)
    np.testing.assert_array_equal(encoder.encode_batches(bound, batches, drop=False).x, got.x)


def test_sqlite_text_that_is_not_utf8_reads_as_replacement_characters(tmp_path: Path) -> None:
    """Second review: one SQLite TEXT cell holding bytes that are not UTF-8 made the driver raise and
    the charged run stop (one bit about one record). It reads as U+FFFD in its cell, as in a CSV."""
    from veil.tables.sources.common import TableSource

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'u.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (c TEXT, y INTEGER)")
        conn.exec_driver_sql("INSERT INTO t VALUES ('ok', 0), (CAST(x'c3ff41' AS TEXT), 1), ('fine', 0)")
    engine.dispose()
    url = f"sqlite:///{tmp_path / 'u.db'}"
    for how in ({"table": "t"}, {"query": "SELECT c, y FROM t"}):
        rows = sql_reader.read_table(TableSource("sql", url, **how)).to_pylist()
        assert [r["c"] for r in rows] == ["ok", "\ufffd\ufffdA", "fine"]


@pytest.mark.parametrize("encoding", ["utf-16", "UTF-32-LE", "utf-7", "iso-2022-jp"])
def test_codecs_that_do_not_resynchronise_are_refused_before_reading(tmp_path: Path, encoding: str) -> None:
    """Second review: after one odd byte a UTF-16 or ISO-2022 decoder read every later row into one
    cell — one record deciding the others. Such an encoding is refused from the declaration alone."""
    from veil.errors import DataError
    from veil.tables.sources import parse_source

    (tmp_path / "t.csv").write_bytes(b"a,y\n1,0\n")
    with pytest.raises(DataError, match="UTF-8"):
        parse_source(f"csv:{tmp_path / 't.csv'}", encoding=encoding)
