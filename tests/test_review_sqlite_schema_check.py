"""SQLite ``--table`` naming a view or a virtual table: the column check touches the schema only.

The check before the full read ran ``SELECT <columns> FROM <name> WHERE false`` on the database,
after reflecting the name: for a view that statement compiles (and, for the planner's choices, may
run) the view's query over the stored rows; for a virtual table its module's code runs (``xConnect``,
``xBestIndex``), which may read any data. Now :func:`veil.tables.sources.sql_reader._sqlite_table_columns`
reads ``sqlite_master``, a plain table's ``PRAGMA table_info``, and a view's columns from a copy of
the schema with no row; a virtual table is refused before any row is read, with a Fix (copy its rows
into a plain table).

Planted: drop the SQLite ``--table`` branch of :func:`veil.tables.sources.sql_reader.read_table`
(``limit == 0``) and ``test_the_column_check_runs_no_statement_over_the_rows`` fails for the plain
table and the view (a ``SELECT ... WHERE false`` on the database), and
``test_a_virtual_table_is_refused_before_reading`` fails (no refusal)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy import event

from _budget_cli import cli
from tables_support import TWO_FEATURES_SCHEMA as SCHEMA
from veil.errors import DataError
from veil.tables.sources import parse_source, source_columns


def _database(path: Path, fts5: bool = False) -> Path:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (a REAL, b REAL, label TEXT)")
    db.executemany("INSERT INTO t VALUES (?, ?, ?)", [(i / 10, -i / 10, str(i % 2)) for i in range(40)])
    db.execute("CREATE VIEW v AS SELECT a, b, label FROM t WHERE a >= 0 ORDER BY a")
    if fts5:
        db.execute("CREATE VIRTUAL TABLE f USING fts5(a, b, label)")
        db.execute("INSERT INTO f SELECT * FROM t")
    db.commit()
    db.close()
    return path


def _has_fts5() -> bool:
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE x USING fts5(a)")
    except sqlite3.OperationalError:
        return False
    return True


@pytest.mark.parametrize("name", ["t", "v"])
def test_the_column_check_runs_no_statement_over_the_rows(tmp_path: Path, name: str) -> None:
    db = _database(tmp_path / "d.db")
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        seen.append(" ".join(statement.split()))

    event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", record)
    try:
        names = source_columns(parse_source(f"sql:sqlite:///{db}", table=name))
    finally:
        event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", record)
    assert names == ["a", "b", "label"]
    assert seen and all("sqlite_master" in s or s.startswith("PRAGMA") for s in seen), seen


@pytest.mark.skipif(not _has_fts5(), reason="this SQLite has no FTS5")
def test_a_virtual_table_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _database(tmp_path / "d.db", fts5=True)
    with pytest.raises(DataError, match="virtual table"):
        source_columns(parse_source(f"sql:sqlite:///{db}", table="f"))
    (tmp_path / "schema.toml").write_text(SCHEMA)
    spec = f"sql:sqlite:///{db}"
    code, _, err = cli(
        capsys, "train", "--dataset", spec, "--table", "f", "--schema", str(tmp_path / "schema.toml"),
        "--epsilon", "1", "--delta", "1e-3", "--no-baseline", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2 and "virtual table" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_view_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _database(tmp_path / "d.db")
    (tmp_path / "schema.toml").write_text(SCHEMA)
    code, out, err = cli(
        capsys, "train", "--dataset", f"sql:sqlite:///{db}", "--table", "v", "--schema",
        str(tmp_path / "schema.toml"), "--epochs", "1", "--batch-size", "8", "--epsilon", "1",
        "--delta", "1e-3", "--no-baseline", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 0, out + err
    assert (tmp_path / "run" / "release" / "model.pt").is_file()
