"""SQL sources on a real PostgreSQL server (started by the test session, stopped at its end)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
sqlalchemy = pytest.importorskip("sqlalchemy")
pytest.importorskip("psycopg")

from _postgres import PostgresServer, pg_bindir, skip_without_postgres  # noqa: E402
from tables_support import gbsg2  # noqa: E402
from test_tables_sources import GBSG2_SCHEMA, load_into_sql  # noqa: E402
from veil.cli.main import main  # noqa: E402
from veil.tables import load_table  # noqa: E402
from veil.tables.schema import parse_schema  # noqa: E402


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    skip_without_postgres()  # in CI: a failure
    server = PostgresServer(pg_bindir()).start()
    try:
        import pyarrow.csv as pcsv

        engine = sqlalchemy.create_engine(server.url())
        load_into_sql(engine, "gbsg2", pcsv.read_csv(gbsg2()))
        engine.dispose()
        yield server
    finally:
        server.stop()


def _schema():
    import tomllib

    return parse_schema(tomllib.loads(GBSG2_SCHEMA))


def test_postgres_table_and_query_encode_like_the_csv(postgres: PostgresServer) -> None:
    schema = _schema()
    csv = load_table(f"csv:{gbsg2()}", schema)
    for kwargs in ({"table": "gbsg2"}, {"query": "SELECT * FROM gbsg2"}):
        got = load_table(f"sql:{postgres.url()}", schema, **kwargs)
        np.testing.assert_array_equal(got.x, csv.x)
        np.testing.assert_array_equal(got.y, csv.y)


def test_schema_infer_from_postgres(postgres: PostgresServer, capsys, tmp_path: Path) -> None:
    out = tmp_path / "s.toml"
    code = main(["schema", "infer", f"sql:{postgres.url()}", "--table", "gbsg2", "--target", "cens",
                 "--ignore", "time", "--out", str(out), "--json"])  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 0, err
    assert 'levels = ["I", "II", "III"]' in out.read_text()


@pytest.mark.parametrize(
    ("url", "extra", "match"),
    [
        ("wrong-password", ["--table", "gbsg2"], "refused the user name or password"),
        ("unreachable", ["--table", "gbsg2"], "cannot be reached"),
        ("ok", ["--table", "no_such_table"], "no such table"),
        ("ok", ["--query", "SELECT * FROM gbsg2 WHERE age < 0"], "no data rows"),  # the non-private draft
        ("ok", ["--query", "SELECT * FROM no_such_table"], "refused the query"),
    ],
)
def test_bad_postgres_input_is_one_line_exit_2_nothing_written(
    postgres: PostgresServer, capsys, tmp_path: Path, url: str, extra: list[str], match: str
) -> None:
    if url == "wrong-password":
        spec = f"sql:{postgres.url(password='not-the-password')}"
    elif url == "unreachable":
        from _postgres import free_port

        spec = f"sql:{postgres.url()}".replace(f":{postgres.port}/", f":{free_port()}/")
    else:
        spec = f"sql:{postgres.url()}"
    out = tmp_path / "s.toml"
    code = main(["schema", "infer", spec, *extra, "--target", "cens", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and match in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert "veil-test-pw" not in err and "not-the-password" not in err  # passwords are never printed
    assert not out.exists()


def test_train_from_postgres_with_the_password_outside_the_url(
    postgres: PostgresServer, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run folder records the dataset URL, so the password travels through PGPASSWORD instead."""
    import json

    import tomllib

    from _postgres import PG_PASSWORD

    schema = tmp_path / "s.toml"
    schema.write_text(GBSG2_SCHEMA)
    monkeypatch.setenv("PGPASSWORD", PG_PASSWORD)
    url = postgres.url().replace(f":{PG_PASSWORD}@", "@")
    run = tmp_path / "run"
    code = main(["train", "--dataset", f"sql:{url}", "--table", "gbsg2", "--schema", str(schema),
                 "--epochs", "2", "--no-baseline", "--json", "--out", str(run)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["dataset"]["n_train"] + json.loads(out)["dataset"]["n_test"] == 686
    assert PG_PASSWORD not in "".join(p.read_text(errors="ignore") for p in run.rglob("*") if p.is_file())
    assert tomllib.loads((run / "config.toml").read_text())["table"] == "gbsg2"


def test_json_array_and_zoned_columns_read_each_row_as_alone(postgres: PostgresServer) -> None:
    """PostgreSQL's JSON, JSONB, ARRAY, DATE and TIMESTAMPTZ columns: each cell reads as the text it
    has alone (Arrow's inference gave an object every other record's keys and promoted one record's
    integers to reals beside another's real), and a value the driver cannot convert (a date past year
    9999, BC or ``infinity``, a JSON number of 5,000 digits) neither stops the read nor shows up in a
    message: those types come back as the server writes them."""
    from veil.tables.sources.common import TableSource
    from veil.tables.sources.sql_reader import read_table

    engine = sqlalchemy.create_engine(postgres.url())
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS shapes")
        conn.exec_driver_sql(
            "CREATE TABLE shapes (id int, doc json, docb jsonb, nums numeric[], seen timestamptz, day date)"
        )
        conn.exec_driver_sql(
            "INSERT INTO shapes VALUES "
            """(1, '{"a": 1}', '{"z": [1, 2]}', '{1,2}', '2020-01-01 12:00+01', '2020-02-03'),"""
            """(2, '{"b": 2}', '[1, 2.5]', '{1.5}', '2020-01-01 12:00+05', 'infinity'),"""
            f"""(3, '[1, "x"]', '{"9" * 5000}', NULL, NULL, '12345-06-07'),"""
            """(4, NULL, NULL, '{3}', '0044-03-15 12:00 BC', '0044-03-15 BC')"""
        )
    engine.dispose()
    url = postgres.url()
    for how in ({"table": "shapes"}, {"query": "SELECT * FROM shapes"}):
        together = read_table(TableSource("sql", url, **how)).to_pylist()
        together.sort(key=lambda r: r["id"])
        for i in (1, 2, 3, 4):
            alone = read_table(
                TableSource("sql", url, query=f"SELECT * FROM shapes WHERE id = {i}")
            ).to_pylist()
            assert alone == [together[i - 1]], f"row {i} reads differently beside the others"
    assert together[0]["doc"] == '{"a": 1}' and together[1]["doc"] == '{"b": 2}'  # as stored
    assert together[1]["docb"] == "[1, 2.5]" and together[0]["nums"] == "[1,2]"
    assert together[1]["day"] == "infinity" and together[2]["day"] == "12345-06-07"
    assert together[2]["docb"] == "9" * 5000


def test_a_cast_failing_on_one_stored_value_never_prints_it(postgres: PostgresServer, tmp_path: Path) -> None:
    """PostgreSQL's error quotes the cell (``invalid input syntax for type integer: "<value>"``): the
    reader's message is the same for two different failing records, wherever they sit, and holds no
    cell text (review revF, F2)."""
    from veil.errors import DataError
    from veil.tables.sources import sql_reader
    from veil.tables.sources.common import TableSource

    query = "SELECT CAST(age_text AS INTEGER) AS age, y FROM t_{}"
    engine = sqlalchemy.create_engine(postgres.url())
    messages = set()
    for i, (bad, at) in enumerate((("41 (approx, SECRET-HIV+)", 0), ("SECRET-other 7", 150))):
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE t_{i} (age_text text, y text)")
            rows = [{"a": str(18 + (j * 7) % 70), "y": "ab"[j % 2]} for j in range(300)]
            rows.insert(at, {"a": bad, "y": "a"})
            conn.execute(sqlalchemy.text(f"INSERT INTO t_{i} VALUES (:a, :y)"), rows)
        with pytest.raises(DataError) as caught:
            sql_reader.read_table(TableSource("sql", postgres.url(), query=query.format(i)))
        text = str(caught.value)
        assert "SECRET" not in text and "invalid input" not in text, text
        messages.add(text.replace(query.format(i), "<query>"))
    engine.dispose()
    assert len(messages) == 1 and "not shown" in messages.pop()


#: The query closes the column check's parenthesis: under the old check (``SELECT * FROM (query) AS
#: veil_q WHERE 1 = 0`` executed) its first SELECT ran over the rows, so the cast decided, on one
#: stored value, whether the check passed.
ESCAPING = (
    "select age, y, cast(p as integer) as j from t) AS v UNION ALL "
    "SELECT * FROM (select age, y, 1 as j from t"
)


def _neighbours(postgres: PostgresServer) -> list[str]:
    """Two databases that differ in one record's ``p``: a number in one, text the cast refuses in the
    other."""
    admin = sqlalchemy.create_engine(postgres.url(), isolation_level="AUTOCOMMIT")
    urls = []
    for name, secret in (("neighbour_a", "7"), ("neighbour_b", "SSN-123-45-6789")):
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        engine = sqlalchemy.create_engine(postgres.url(database=name))
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (age real, p text, y text)")
            conn.exec_driver_sql("INSERT INTO t VALUES (50, %(p)s, 'a')", {"p": secret})
            conn.exec_driver_sql("INSERT INTO t SELECT 20 + i, '3', 'ab' FROM generate_series(1, 30) AS i")
        engine.dispose()
        urls.append(postgres.url(database=name))
    admin.dispose()
    return urls


def _check_outcome(url: str, query: str) -> str:
    """What the column check says: the columns it found, or its message."""
    from veil.errors import DataError
    from veil.tables.sources import sql_reader
    from veil.tables.sources.common import TableSource

    try:
        return repr(sql_reader.read_table(TableSource("sql", url, query=query), limit=0).column_names)
    except DataError as exc:
        return str(exc)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (ESCAPING, "syntax error"),  # escapes the wrapper: not one statement alone
        ("select age, y from t; select cast(p as integer) from t", "multiple commands"),
        ("select age, y, cast(p as integer) as j from t", "['age', 'y', 'j']"),  # fails only when run
        ("select age, y, cast(p as integer) as j from t union select age, y, 1 from t", "['age', 'y', 'j']"),
    ],
)
def test_the_column_check_of_a_query_runs_no_row_on_neighbouring_databases(
    postgres: PostgresServer, query: str, expected: str
) -> None:
    """The check describes the query without running it: two databases differing in one record give
    the same outcome and the same message, whatever the query does over the rows."""
    a, b = (_check_outcome(url, query) for url in _neighbours(postgres))
    assert a == b, (a, b)
    assert expected in a and "SSN" not in a, a


def test_a_query_that_writes_is_refused_by_the_check_and_never_run(postgres: PostgresServer) -> None:
    from veil.tables.sources import sql_reader
    from veil.tables.sources.common import TableSource

    url = _neighbours(postgres)[0]
    for query in ("select 1; drop table t", "delete from t returning *", "drop table t"):
        assert "refused the query" in _check_outcome(url, query)
    count = TableSource("sql", url, query="select count(*) as n from t")
    assert sql_reader.read_table(count).to_pylist() == [{"n": 31}]
