"""``veil schema infer --epsilon`` sorts each cell (number, text, missing) by a rule on the cell alone.

Its kind counts, bounds and level histograms are released with noise for sensitivity 1: adding one
record must change each count by at most one. Sorting cells by the column's type broke that (review):
one record ``"x"`` made a CSV column of reals text, so its 100 ``nan`` cells turned from missing into
text (a count moved by 101), and 100 booleans changed their level from ``true`` to ``True``. Checked
here as additivity: the counts of a column equal the sum of the counts of its parts read apart.
Planted: restore the typed CSV read (``read_source``) in ``_Columns`` and this test fails.
"""

from __future__ import annotations

import csv
import itertools
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
sqlalchemy = pytest.importorskip("sqlalchemy")

CELLS = [
    "1.5",
    "7",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "True",
    "false",
    "2024-01-01 10:00",
    "x",
    "",
    "NA",
    " 3 ",
    "1e3",
]


def _counts(path: Path, values: list[str]) -> tuple[int, int, int, Counter[str]]:
    from veil.tables.infer import _cells, _Columns, _value_counts
    from veil.tables.sources import parse_source

    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["c", "y"])
        writer.writerows([[v, "0"] for v in values])
    numbers, words, missing = _cells(_Columns(parse_source(f"csv:{path}"), ["c"]).column("c"))
    return (
        len(numbers),
        sum(w is not None for w in words),
        int(missing.sum()),
        Counter(_value_counts(numbers, words)),
    )


def _add(a: tuple[int, int, int, Counter[str]], b: tuple[int, int, int, Counter[str]]):  # type: ignore[no-untyped-def]
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


@pytest.mark.parametrize(("a", "b"), list(itertools.permutations(CELLS, 2)))
def test_one_more_record_changes_each_count_by_its_own_cell_only(tmp_path: Path, a: str, b: str) -> None:
    many = [a] * 5
    together = _counts(tmp_path / "ab.csv", [*many, b])
    apart = _add(_counts(tmp_path / "a.csv", many), _counts(tmp_path / "b.csv", [b]))
    assert together == apart, f"{b!r} beside {a!r} moved the counts of the {a!r} cells"


def test_sql_cells_sorted_as_alone(tmp_path: Path) -> None:
    """The same on a SQLite column holding a type per cell (reals with an infinity, text, booleans)."""
    from veil.tables.infer import _cells, _Columns
    from veil.tables.sources import parse_source

    def counts(rows: list[object]) -> tuple[int, int, int]:
        db = tmp_path / f"t{len(list(tmp_path.iterdir()))}.db"
        engine = sqlalchemy.create_engine(f"sqlite:///{db}")
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (c, y)")
            conn.exec_driver_sql("INSERT INTO t VALUES (?, 0)", [(r,) for r in rows])
        engine.dispose()
        numbers, words, missing = _cells(
            _Columns(parse_source(f"sql:sqlite:///{db}", table="t"), ["c"]).column("c")
        )
        return len(numbers), sum(w is not None for w in words), int(missing.sum())

    base = [1.5] * 5 + [float("inf")] * 3 + [True] * 2
    for extra in ("x", 2.5, None, b"\x00"):
        with_extra = counts([*base, extra])
        alone = counts([extra])
        assert with_extra == tuple(x + y for x, y in zip(counts(base), alone, strict=True)), extra
