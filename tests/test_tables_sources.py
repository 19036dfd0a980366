"""Readers (CSV, Parquet, SQLite) and the `veil schema` command's handling of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
sqlalchemy = pytest.importorskip("sqlalchemy")

from tables_support import gbsg2  # noqa: E402
from veil.cli.main import main  # noqa: E402
from veil.tables import load_table  # noqa: E402
from veil.tables.schema import load_schema  # noqa: E402

GBSG2_SCHEMA = """
reviewed = true

[columns.horTh]
type = "categorical"
levels = ["no", "yes"]

[columns.age]
type = "numeric"
bounds = [18, 100]

[columns.menostat]
type = "categorical"
levels = ["Pre", "Post"]

[columns.tsize]
type = "numeric"
bounds = [0, 200]

[columns.tgrade]
type = "ordinal"
levels = ["I", "II", "III"]

[columns.pnodes]
type = "numeric"
bounds = [0, 60]

[columns.progrec]
type = "numeric"
bounds = [0, 3000]

[columns.estrec]
type = "numeric"
bounds = [0, 3000]

[columns.time]
type = "ignored"

[columns.cens]
role = "target"
classes = ["0", "1"]
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """GBSG2 as CSV, Parquet and a SQLite table, and its reviewed schema."""
    import pyarrow.csv as pcsv

    folder = tmp_path_factory.mktemp("gbsg2")
    table = pcsv.read_csv(gbsg2())
    pq.write_table(table, folder / "gbsg2.parquet", row_group_size=100)
    engine = sqlalchemy.create_engine(f"sqlite:///{folder / 'gbsg2.db'}")
    load_into_sql(engine, "gbsg2", table)
    engine.dispose()
    (folder / "schema.toml").write_text(GBSG2_SCHEMA)
    return {
        "csv": f"csv:{gbsg2()}",
        "parquet": f"parquet:{folder / 'gbsg2.parquet'}",
        "sql": f"sql:sqlite:///{folder / 'gbsg2.db'}",
        "schema": str(folder / "schema.toml"),
        "folder": str(folder),
    }


def load_into_sql(engine, name: str, table) -> None:
    """Create ``name`` with SQL types from the Arrow types and insert the rows."""
    sa = sqlalchemy
    types = {"int64": sa.BigInteger, "double": sa.Float, "string": sa.Text}
    cols = [sa.Column(f.name, types[str(f.type)]) for f in table.schema]
    t = sa.Table(name, sa.MetaData(), *cols)
    with engine.begin() as conn:
        t.drop(conn, checkfirst=True)
        t.create(conn)
        conn.execute(t.insert(), table.to_pylist())


def test_csv_parquet_and_sqlite_encode_identically(sources: dict[str, str]) -> None:
    schema = load_schema(sources["schema"])
    csv = load_table(sources["csv"], schema)
    assert csv.x.shape == (686, 21)
    for other in (
        load_table(sources["parquet"], schema),
        load_table(sources["sql"], schema, table="gbsg2"),
        load_table(sources["sql"], schema, query="SELECT * FROM gbsg2"),
    ):
        np.testing.assert_array_equal(other.x, csv.x)
        np.testing.assert_array_equal(other.y, csv.y)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_schema_infer_and_check_from_every_source(sources: dict[str, str], capsys, tmp_path: Path) -> None:
    for name, extra in (("csv", []), ("parquet", []), ("sql", ["--table", "gbsg2"])):
        out = tmp_path / f"{name}.toml"
        code, stdout, err = _cli(capsys, "schema", "infer", sources[name], *extra, "--target", "cens",
                                 "--ignore", "time", "--out", str(out), "--json")  # fmt: skip
        assert code == 0, err
        assert '"reviewed": false' in stdout
        assert load_schema(out).column("tgrade").levels == ("I", "II", "III")
        code, _, err = _cli(capsys, "schema", "check", str(out), "--dataset", sources[name], *extra)
        assert code == 0, err


BAD_SQLITE = [
    (["--table", "nope"], "no such table"),
    (["--query", "SELECT * FROM missing_table"], "refused the query"),
]


@pytest.mark.parametrize(("extra", "match"), BAD_SQLITE)
def test_bad_sql_input_is_one_line_exit_2_nothing_written(
    sources, capsys, tmp_path: Path, extra, match
) -> None:
    out = tmp_path / "s.toml"
    code, _, err = _cli(
        capsys, "schema", "infer", sources["sql"], *extra, "--target", "cens", "--out", str(out)
    )
    assert code == 2 and match in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
    code, _, err = _cli(capsys, "schema", "check", sources["schema"], "--dataset", sources["sql"], *extra)
    assert code == 2 and match in err and err.count("\n") == 1


def test_a_query_with_no_rows_is_read_as_zero_rows(sources, capsys, tmp_path: Path) -> None:
    """No refusal on the row count after reading (a table of zero rows, as a header-only CSV): the
    non-private draft says there is nothing to draft from; the check finds nothing against the schema."""
    empty = ["--query", "SELECT * FROM gbsg2 WHERE age > 1000"]
    out = tmp_path / "s.toml"
    code, _, err = _cli(
        capsys, "schema", "infer", sources["sql"], *empty, "--target", "cens", "--out", str(out)
    )
    assert code == 2 and "no data rows" in err and err.count("\n") == 1 and not out.exists(), err
    code, _, err = _cli(capsys, "schema", "check", sources["schema"], "--dataset", sources["sql"], *empty)
    assert code == 0 and "returned no rows" not in err, err


def test_unreachable_sqlite_database(capsys, tmp_path: Path) -> None:
    out = tmp_path / "s.toml"
    url = f"sql:sqlite:///{tmp_path}/no/such/folder/x.db"
    code, _, err = _cli(capsys, "schema", "infer", url, "--table", "t", "--target", "cens", "--out", str(out))
    assert code == 2 and "does not exist" in err and err.count("\n") == 1 and not out.exists()


@pytest.mark.parametrize(
    ("edit_schema", "edit_csv", "match"),
    [
        (
            lambda s: s.replace('"horTh"', '"hormone"').replace("columns.horTh", "columns.hormone"),
            None,
            "schema column 'hormone'.*missing from the data",
        ),
    ],
)
def test_bad_table_input_is_one_line_exit_2(
    sources, capsys, tmp_path: Path, edit_schema, edit_csv, match
) -> None:
    schema = tmp_path / "schema.toml"
    schema.write_text(edit_schema(GBSG2_SCHEMA) if edit_schema else GBSG2_SCHEMA)
    data = tmp_path / "data.csv"
    text = gbsg2().read_text()
    data.write_text(edit_csv(text) if edit_csv else text)
    code, _, err = _cli(capsys, "schema", "check", str(schema), "--dataset", f"csv:{data}")
    assert code == 2 and err.count("\n") == 1, err
    import re

    assert re.search(match, err), err


def test_schema_check_counts_a_text_cell_in_a_numeric_column_as_missing(
    sources, capsys, tmp_path: Path
) -> None:
    """Issue 23, item 7: a per-record rule, not a refusal; the count is shown to the owner."""
    schema = tmp_path / "schema.toml"
    schema.write_text(GBSG2_SCHEMA)
    data = tmp_path / "data.csv"
    data.write_text(gbsg2().read_text().replace("no,70,Post,21", "no,seventy,Post,21"))
    code, out, err = _cli(capsys, "schema", "check", str(schema), "--dataset", f"csv:{data}", "--json")
    assert code == 0, err
    assert json.loads(out)["cells not a number made missing (not private)"] == 1
    assert "seventy" not in out + err


def test_schema_infer_refuses_to_overwrite(sources, capsys, tmp_path: Path) -> None:
    out = tmp_path / "s.toml"
    out.write_text("reviewed = true\n")
    code, _, err = _cli(capsys, "schema", "infer", sources["csv"], "--target", "cens", "--out", str(out))
    assert code == 2 and "--force" in err and out.read_text() == "reviewed = true\n"


def test_schema_infer_with_epsilon_writes_a_dp_schema(sources, capsys, tmp_path: Path) -> None:
    out = tmp_path / "dp.toml"
    code, _, err = _cli(capsys, "schema", "infer", sources["parquet"], "--target", "cens", "--ignore", "time",
                        "--epsilon", "50", "--out", str(out), "--json")  # fmt: skip
    assert code == 0, err
    schema = load_schema(out)
    assert schema.reviewed == "dp" and schema.dp["epsilon"] <= 50 and schema.dp["delta"] == 1e-7
    schema.require_reviewed()
    assert schema.column("time").type == "ignored"


def test_a_text_dataset_with_a_password_in_its_url_is_refused_before_it_is_read() -> None:
    from veil.errors import ConfigError
    from veil.text.data import _sql_columns

    with pytest.raises(ConfigError, match="password") as err:
        _sql_columns("sql:postgresql://u:s3cret@127.0.0.1:1/db", "t", None)  # nothing listens there
    assert "s3cret" not in str(err.value)


def test_schema_check_counts_the_rows_a_drop_policy_drops(capsys, tmp_path: Path) -> None:
    """A value outside the bounds under ``outside = "error"`` (now: drop the row) is no refusal: the
    check succeeds and counts the dropped rows as non-private."""
    schema = tmp_path / "schema.toml"
    schema.write_text(GBSG2_SCHEMA.replace("bounds = [18, 100]", 'bounds = [18, 60]\noutside = "error"'))
    code, out, err = _cli(capsys, "schema", "check", str(schema), "--dataset", f"csv:{gbsg2()}", "--json")
    assert code == 0, err
    result = json.loads(out)
    older = sum(int(float(r.split(",")[1]) > 60) for r in gbsg2().read_text().splitlines()[1:])  # age
    assert older > 0 and result["rows dropped outside (not private)"] == older
