"""Each record's cells are read and encoded by a rule on the cell alone (veil.tables.sources.cells).

After a private row is read nothing may depend on one other record: a SQLite column whose cells hold
values of several types is read (it stopped the run with Arrow's type error, after the charge), and
a float cell's text does not depend on whether the other cells are integral.
"""

from __future__ import annotations

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
from veil.tables.sources.cells import cell_text, column_texts, number_text, number_texts  # noqa: E402

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
    monkeypatch.setattr(sql_reader, "SQL_PARTITION_ROWS", 2)  # ints first, then text: two types
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


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.lists(st.one_of(finite, st.none(), st.just(math.nan)), max_size=40))
def test_number_texts_is_number_text_cell_by_cell(values: list[float | None]) -> None:
    got = number_texts(pa.array(values, pa.float64(), from_pandas=False)).to_pylist()
    assert got == [None if v is None else number_text(v) for v in values]


@given(finite)
def test_a_number_text_reads_back_as_the_same_number(v: float) -> None:
    text = number_text(v)
    assert text is not None and float(text) == v


def test_cell_rules_for_other_types() -> None:
    import datetime
    import decimal

    assert [cell_text(v) for v in (True, 3, 3.0, decimal.Decimal("2.50"), b"\xff7", None)] == [
        "true", "3", "3", "2.5", "ff37", None,
    ]  # fmt: skip
    assert cell_text(datetime.date(2020, 1, 2)) == "2020-01-02"
    stamps = pa.chunked_array([pa.array([datetime.datetime(2020, 1, 2, 3, 4)])])
    assert column_texts(stamps).to_pylist() == [cell_text(datetime.datetime(2020, 1, 2, 3, 4))]
