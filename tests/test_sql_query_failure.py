"""A ``--query`` that fails on one stored value (F2 of the review revF).

Once the query runs over the rows, the database's error text can quote the stored value (PostgreSQL:
``invalid input syntax for type integer: "<value>"``, tested in ``test_tables_postgres.py``), and
where the failure surfaces (at ``execute`` or while fetching) depends on where the record sits. The
reader shows one fixed message for any such failure, whichever record and wherever; the run stays
charged with nothing released. The column-name check that runs the query under ``WHERE 1 = 0`` shows
the same message (review revG F1): a query that closes the check's parenthesis runs a SELECT over the
rows outside ``WHERE 1 = 0``, so its error could quote a stored value.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("pyarrow")

from veil.cli.main import main
from veil.errors import DataError
from veil.tables.sources import sql_reader
from veil.tables.sources.common import TableSource

SCHEMA = (
    'reviewed = true\n[columns.age]\ntype = "numeric"\nbounds = [18.0, 100.0]\n'
    '[columns.y]\nrole = "target"\nclasses = ["a", "b"]\n'
)
QUERIES = [
    "SELECT json_extract(payload, '$.age') AS age, y FROM t",
    "SELECT json_extract(payload, '$.age') AS age, y FROM t ORDER BY age",
]
BAD = ['{"age": 41 SECRET-HIV', '{"SECRET-diagnosis": ']  # two different malformed records


def _database(path: Path, bad: str | None, at: int) -> str:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (payload TEXT, y TEXT)")
    rows = [(json.dumps({"age": 18 + (i * 7) % 70}), "ab"[i % 2]) for i in range(120)]
    if bad is not None:
        rows.insert(at, (bad, "a"))
    con.executemany("INSERT INTO t VALUES (?, ?)", rows)
    con.commit()
    con.close()
    return f"sqlite:///{path}"


def _error(url: str, query: str) -> str:
    return _error_at(url, query, None)


def _error_at(url: str, query: str, limit: int | None) -> str:
    with pytest.raises(DataError) as caught:
        sql_reader.read_table(TableSource("sql", url, query=query), limit=limit)
    return str(caught.value)


def test_a_query_failing_on_one_record_gives_one_message_whichever_record_and_wherever(
    tmp_path: Path,
) -> None:
    messages = set()
    for i, bad in enumerate(BAD):
        for at in (0, 60, 120):
            url = _database(tmp_path / f"d{i}-{at}.db", bad, at)
            for query in QUERIES:
                text = _error(url, query)
                assert "SECRET" not in text and "malformed" not in text, text
                messages.add(text.replace(query, "<query>"))
    assert len(messages) == 1, messages
    assert "not shown" in messages.pop()


def test_the_column_check_runs_on_the_schema_without_rows_and_shows_its_text(tmp_path: Path) -> None:
    """SQLite: the column check runs on an in-memory copy of the schema (no row), so the database's
    text is shown there (it can quote only the query and the schema)."""
    url = _database(tmp_path / "d.db", None, 0)
    with pytest.raises(DataError, match="no such column") as caught:
        sql_reader.read_table(TableSource("sql", url, query="SELECT nope FROM t"), limit=0)
    assert "without rows" in str(caught.value)


#: revG F1: the query closes the column check's parenthesis, so ``json_extract('{}', p)`` runs over
#: the rows outside ``WHERE 1 = 0``; SQLite's error quotes the path it was given, a stored value.
ESCAPING = (
    "select age, y, json_extract('{}', p) as j from t) AS v UNION ALL "
    "SELECT * FROM (select age, y, 1 as j from t"
)


def _neighbour(path: Path, secret: str) -> str:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (age REAL, p TEXT, y TEXT)")
    con.execute("INSERT INTO t VALUES (50, ?, 'a')", (secret,))
    con.executemany("INSERT INTO t VALUES (?, '$.x', ?)", [(20 + i, "ab"[i % 2]) for i in range(30)])
    con.commit()
    con.close()
    return f"sqlite:///{path}"


def test_a_query_escaping_the_column_check_never_shows_a_stored_value(tmp_path: Path) -> None:
    # the check runs on the schema without rows: it passes for both neighbours (so whether a job goes
    # on to charge depends on no record); the full read fails on b.db with the fixed message, a.db's
    # record is a valid path: the message never holds the value
    a = _neighbour(tmp_path / "a.db", "$.x")
    b = _neighbour(tmp_path / "b.db", "SSN-123-45-6789")
    for url in (a, b):
        columns = sql_reader.read_table(TableSource("sql", url, query=ESCAPING), limit=0).column_names
        assert columns == ["age", "y", "j"]
    text = _error_at(b, ESCAPING, None)
    assert "SSN" not in text and "JSON path" not in text and "not shown" in text, text


def test_the_escaping_query_leaks_nothing_through_schema_infer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "reg.db"))
    url = _neighbour(tmp_path / "b.db", "SSN-123-45-6789")
    code = main(["schema", "infer", f"sql:{url}", "--query", ESCAPING, "--target", "y",
                 "--out", str(tmp_path / "s.toml"), "--epsilon", "1"])  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "not shown" in err, err
    assert "SSN" not in err and not (tmp_path / "s.toml").exists()


def _train(url: str, query: str, tmp_path: Path, name: str) -> int:
    schema = tmp_path / "s.toml"
    schema.write_text(SCHEMA)
    code = main(["train", "--dataset", f"sql:{url}", "--query", query, "--dataset-id", "t",
                 "--schema", str(schema), "--epsilon", "1", "--delta", "1e-4", "--epochs", "1",
                 "--batch-size", "32", "--no-baseline", "--out", str(tmp_path / name)])  # fmt: skip
    return code


def test_train_refuses_the_same_way_for_either_record_and_stays_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = []
    for i, (bad, at) in enumerate(((BAD[0], 0), (BAD[1], 60))):
        monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / f"reg{i}.db"))
        url = _database(tmp_path / f"t{i}.db", bad, at)
        code = _train(url, QUERIES[0], tmp_path, f"run{i}")
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "SECRET" not in err and not (tmp_path / f"run{i}").exists()
        errors.append(err)
        assert main(["budget", "show"]) == 0
        shown, _ = capsys.readouterr()
        assert "committed" in shown and "released" not in shown  # the reservation is kept
    assert errors[0] == errors[1]


@pytest.mark.parametrize("command", ["check", "predict"])
def test_schema_check_and_predict_share_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    url = _database(tmp_path / "d.db", BAD[0], 5)
    if command == "check":
        schema = tmp_path / "s.toml"
        schema.write_text(SCHEMA)
        args = ["schema", "check", str(schema), "--dataset", f"sql:{url}", "--query", QUERIES[0]]
    else:
        assert _train(_database(tmp_path / "good.db", None, 0), QUERIES[0], tmp_path, "run") == 0
        capsys.readouterr()
        args = ["predict", str(tmp_path / "run"), "--dataset", f"sql:{url}", "--query", QUERIES[0],
                "--out", str(tmp_path / "p.csv")]  # fmt: skip
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 2 and "not shown" in err, err
    assert "SECRET" not in err and "malformed" not in err, err
