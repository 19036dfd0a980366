"""revK K4: the full read of a SQLite ``--table`` selected every reflected column, so an undeclared
generated column (``g GENERATED ALWAYS AS (abs(a))``, a schema migration) was computed on every row
and failed on one stored value (``a = -2**63``: "integer overflow") after the run was charged: D
released, D + that row did not. With a schema the full read now selects only the declared columns
(:func:`veil.tables.sources.read_source` → ``sql_reader.read_table(columns=...)``), as quoted
identifiers, so a column veil does not use is never computed.

Planted: pass ``columns=None`` to ``sql_reader.read_table`` in ``read_source`` and
``test_an_undeclared_generated_column_is_never_computed`` and
``test_synth_releases_on_the_neighbour_with_the_overflowing_row`` fail (the database's refusal)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy import event

from _budget_cli import cli
from veil.tables.schema import load_schema
from veil.tables.sources import parse_source, read_source

SCHEMA = """reviewed = true
[columns.a]
type = "numeric"
bounds = [-4, 4]
[columns.b]
type = "numeric"
bounds = [-4, 4]
[columns."label col"]
role = "target"
classes = ["0", "1"]
"""


def _database(path: Path, overflowing: bool) -> None:
    db = sqlite3.connect(path)
    db.execute('CREATE TABLE t (a INTEGER, b REAL, "label col" TEXT)')
    rows = [(i % 5 - 2, -i / 10 % 3, str(i % 2)) for i in range(40)]
    db.executemany('INSERT INTO t (a, b, "label col") VALUES (?, ?, ?)', rows)
    if overflowing:
        db.execute("INSERT INTO t (a, b, \"label col\") VALUES (?, 0.5, '1')", (-(2**63),))
    db.execute("ALTER TABLE t ADD COLUMN g INTEGER GENERATED ALWAYS AS (abs(a)) VIRTUAL")
    db.commit()
    db.close()


def test_an_undeclared_generated_column_is_never_computed(tmp_path: Path) -> None:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    _database(tmp_path / "d.db", overflowing=True)
    statements: list[str] = []
    listener = lambda *args: statements.append(str(args[2]))  # noqa: E731 - (conn, cursor, statement, ...)
    event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", listener)
    try:
        raw = read_source(
            parse_source(f"sql:sqlite:///{tmp_path / 'd.db'}", table="t"),
            load_schema(tmp_path / "schema.toml"),
        )
    finally:
        event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", listener)
    assert raw.table.num_rows == 41
    assert raw.table.column_names == ["a", "b", "label col"]
    full_reads = [s for s in statements if "FROM" in s and "sqlite_master" not in s and "PRAGMA" not in s]
    assert full_reads, statements
    for statement in full_reads:
        selected = statement.split("FROM")[0]
        assert re.search(r"\bg\b", selected) is None, statement
        assert '"label col"' in selected, statement


def test_synth_releases_on_the_neighbour_with_the_overflowing_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's k9, on D' (D + the overflowing row): exit 0 and a release, as D."""
    (tmp_path / "schema.toml").write_text(SCHEMA)
    _database(tmp_path / "d1.db", overflowing=True)
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "reg.db"))
    code, stdout, err = cli(
        capsys, "synth", "--dataset", f"sql:sqlite:///{tmp_path / 'd1.db'}", "--table", "t",
        "--schema", str(tmp_path / "schema.toml"), "--epsilon", "1", "--delta", "1e-3", "--rows", "10",
        "--iterations", "5", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 0, stdout + err
    assert any((tmp_path / "out" / "release").iterdir())
