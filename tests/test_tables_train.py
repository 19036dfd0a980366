"""`veil train --schema` on real tables (CSV, Parquet, SQLite) and `veil predict`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
sqlalchemy = pytest.importorskip("sqlalchemy")

from tables_support import gbsg2  # noqa: E402
from test_tables_sources import GBSG2_SCHEMA, load_into_sql  # noqa: E402
from veil.cli.main import main  # noqa: E402

FAST = ["--epochs", "2", "--epsilon", "3", "--json"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pyarrow.csv as pcsv

    folder = tmp_path_factory.mktemp("train")
    (folder / "schema.toml").write_text(GBSG2_SCHEMA)
    table = pcsv.read_csv(gbsg2())
    pq.write_table(table, folder / "gbsg2.parquet")
    engine = sqlalchemy.create_engine(f"sqlite:///{folder / 'gbsg2.db'}")
    load_into_sql(engine, "gbsg2", table)
    engine.dispose()
    return {"folder": folder, "schema": folder / "schema.toml", "db": folder / "gbsg2.db"}


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("runs") / "csv"
    code = main(
        ["train", "--dataset", f"csv:{gbsg2()}", "--schema", str(files["schema"]), *FAST, "--out", str(out)]
    )
    assert code == 0
    return out, json.loads((out / "report.json").read_text())


def test_train_on_a_csv_table_through_its_schema(trained: tuple[Path, dict]) -> None:
    out, report = trained
    assert report["preprocessing"]["method"] == "schema" and report["preprocessing"]["public"]
    assert report["epsilon_spent"] <= 3 and report["dataset"]["num_classes"] == 2
    assert "encoder.json" in report["files"] and (out / "encoder.json").is_file()
    assert report["non_private"]["baseline_test_accuracy"] is not None
    baseline = report["non_private"]["history"]["baseline"]
    assert report["non_private"]["baseline_stopped"].startswith("converged")  # small data: not capped
    assert [h["epoch"] for h in baseline] == [float(i) for i in range(1, len(baseline) + 1)]


def test_the_baseline_takes_at_most_ten_steps_per_dp_step(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """q = 1 (one DP step per epoch), 2 epochs, no floor: the cap is 20 optimizer steps, and the
    baseline says it stopped there (its validation loss may still have been falling)."""
    import veil.pipeline.baseline as baseline
    from veil.config import make_config
    from veil.training.prepare import prepare_run

    cfg = {"dataset": f"csv:{gbsg2()}", "table_schema": str(files["schema"]), "epochs": 2}
    n_train = prepare_run(make_config(cfg), None, check=False).data.n_train  # the keyed split's share
    plan = prepare_run(make_config({**cfg, "batch_size": n_train}), None, check=False)
    assert plan.steps.steps_planned == 2
    monkeypatch.setattr(baseline, "MIN_STEPS", 0)
    monkeypatch.setattr(baseline, "LBFGS_ITERATIONS", 3)  # a convex model: 3 L-BFGS steps a round
    result = baseline.train_baseline(plan, "cpu")
    assert result.stopped.startswith(f"capped at {baseline.STEPS_PER_DP_STEP * 2} steps")
    assert len(result.history) <= 20


def test_train_from_sqlite(files: dict[str, Path], capsys, tmp_path: Path) -> None:
    """(Parquet and SQL sources encode exactly like the CSV: tests/test_tables_sources.py.)"""
    source = [
        "--dataset",
        f"sql:sqlite:///{files['db']}",
        "--table",
        "gbsg2",
        "--schema",
        str(files["schema"]),
    ]
    code, out, err = _run(capsys, "train", *source, *FAST, "--no-baseline", "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert json.loads(out)["dataset"]["n_train"] + json.loads(out)["dataset"]["n_test"] == 686


def test_the_label_set_is_the_schema_s_not_the_data_s(tmp_path: Path) -> None:
    """A declared class absent from the data still has its output: the model's width reveals nothing."""
    from veil.config import make_config
    from veil.pipeline.data import prepare
    from veil.pipeline.model import build_net

    schema = tmp_path / "s.toml"
    schema.write_text(GBSG2_SCHEMA.replace('classes = ["0", "1"]', 'classes = ["0", "1", "2"]'))
    prepared = prepare(make_config({"dataset": f"csv:{gbsg2()}", "table_schema": str(schema)}))
    assert prepared.data.classes == ["0", "1", "2"] and set(np.unique(prepared.data.y_train)) == {0, 1}
    net = build_net(prepared.cfg, prepared.data, 0)
    assert net(__import__("torch").zeros(1, prepared.data.input_shape[0])).shape == (1, 3)


BAD_TRAIN = [
    ("reviewed = true", "reviewed = false", None, "set reviewed = true"),
    ("[columns.time]", "[columns.tim]", None, "schema column 'tim'"),
]


@pytest.mark.parametrize(("old", "new", "edit_csv", "match"), BAD_TRAIN)
def test_bad_table_input_to_train_is_one_line_exit_2_nothing_written(
    capsys, tmp_path: Path, old, new, edit_csv, match: str
) -> None:
    schema = tmp_path / "s.toml"
    schema.write_text(GBSG2_SCHEMA.replace(old, new) if old else GBSG2_SCHEMA)
    data = tmp_path / "d.csv"
    data.write_text(edit_csv(gbsg2().read_text()) if edit_csv else gbsg2().read_text())
    run = tmp_path / "run"
    code, _, err = _run(
        capsys, "train", "--dataset", f"csv:{data}", "--schema", str(schema), *FAST, "--out", str(run)
    )
    assert code == 2 and match in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not run.exists()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--query", "SELECT * FROM gbsg2 WHERE age > 1000"], "N = 0"),  # on veil train's public N
        (["--table", "missing"], "no such table"),
    ],
)
def test_bad_sql_input_to_train(files, capsys, tmp_path: Path, extra: list[str], match: str) -> None:
    run = tmp_path / "run"
    code, _, err = _run(capsys, "train", "--dataset", f"sql:sqlite:///{files['db']}", *extra,
                        "--schema", str(files["schema"]), *FAST, "--out", str(run))  # fmt: skip
    assert code == 2 and match in err and err.count("\n") == 1, err
    assert not run.exists()


def test_a_password_in_the_url_is_refused_before_anything_is_read(files, capsys, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, _, err = _run(capsys, "train", "--dataset", "sql:postgresql+psycopg://u:secret@127.0.0.1:1/db",
                        "--table", "t", "--schema", str(files["schema"]), *FAST,
                        "--out", str(run))  # fmt: skip
    assert code == 2 and "PGPASSWORD" in err and "secret" not in err and not run.exists()


def test_predict_writes_one_prediction_per_row_encoded_as_in_training(
    trained, capsys, tmp_path: Path
) -> None:
    run, _ = trained
    preds = tmp_path / "preds.csv"
    code, _, err = _run(
        capsys, "predict", str(run), "--dataset", f"csv:{gbsg2()}", "--out", str(preds), "--json"
    )
    assert code == 0, err
    rows = list(csv.DictReader(preds.open()))
    assert len(rows) == 686 and {r["prediction"] for r in rows} <= {"0", "1"}
    p = np.array([[float(r["p_0"]), float(r["p_1"])] for r in rows])
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-5)
    # A row predicted alone gets the prediction it got among the others (per-row encoding end to end).
    lines = gbsg2().read_text().splitlines()
    single = tmp_path / "one.csv"
    single.write_text(lines[0] + "\n" + lines[5] + "\n")
    code, _, err = _run(
        capsys, "predict", str(run), "--dataset", f"csv:{single}", "--out", str(tmp_path / "1.csv")
    )
    assert code == 0, err
    alone = next(csv.DictReader((tmp_path / "1.csv").open()))
    assert alone["prediction"] == rows[4]["prediction"] and abs(float(alone["p_1"]) - p[4, 1]) < 1e-6


def test_predict_refuses_a_value_the_schema_forbids_and_writes_nothing(
    trained, capsys, tmp_path: Path
) -> None:
    run, _ = trained
    data = tmp_path / "new.csv"
    data.write_text(gbsg2().read_text().replace("no,70,Post,21", "no,70,Post,huge"))
    preds = tmp_path / "preds.csv"
    # A cell that is not a number is missing (the per-record rule of training, issue 23 item 7).
    code, _, err = _run(capsys, "predict", str(run), "--dataset", f"csv:{data}", "--out", str(preds))
    assert code == 0, err
    assert len(preds.read_text().splitlines()) == len(gbsg2().read_text().splitlines())
    preds.unlink()
    code, _, err = _run(capsys, "predict", str(tmp_path), "--dataset", f"csv:{data}", "--out", str(preds))
    assert code == 2 and ("config.toml" in err or "encoder.json" in err)


def test_wide_categorical_trains_with_embeddings_and_predicts(capsys, tmp_path: Path) -> None:
    g = np.random.default_rng(0)
    n = 600
    city = g.integers(0, 40, n)
    y = (city % 2 == 0).astype(int)
    table = pa.table({"city": [f"c{c}" for c in city], "x": g.normal(size=n), "y": y.astype(str)})
    pq.write_table(table, tmp_path / "t.parquet")
    levels = ", ".join(f'"c{i}"' for i in range(40))
    schema = tmp_path / "s.toml"
    schema.write_text(
        "reviewed = true\n"
        f'[columns.city]\ntype = "categorical"\nlevels = [{levels}]\nencoding = "embedding"\n'
        '[columns.x]\ntype = "numeric"\nbounds = [-4, 4]\n'
        '[columns.y]\nrole = "target"\nclasses = ["0", "1"]\n'
    )
    run = tmp_path / "run"
    source = ["--dataset", f"parquet:{tmp_path / 't.parquet'}", "--schema", str(schema)]
    code, out, err = _run(capsys, "train", *source, "--epochs", "3", "--epsilon", "8", "--no-baseline",
                          "--json",
                          "--out", str(run))  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["parameters"] > 40  # the embedding table is trained
    code, _, err = _run(capsys, "predict", str(run), "--dataset", f"parquet:{tmp_path / 't.parquet'}",
                        "--out", str(tmp_path / "p.csv"))  # fmt: skip
    assert code == 0, err


def test_predict_skips_a_row_a_drop_policy_drops_and_keeps_row_numbers(
    trained, capsys, tmp_path: Path
) -> None:
    """A row the schema's ``"drop"`` policy drops gets no prediction; the others keep their row number."""
    import json
    import shutil

    run, _ = trained
    strict = tmp_path / "strict"
    shutil.copytree(run, strict)
    encoder = json.loads((strict / "encoder.json").read_text())
    encoder["schema"]["columns"]["age"]["outside"] = "drop"
    (strict / "encoder.json").write_text(json.dumps(encoder))
    data = tmp_path / "new.csv"
    lines = gbsg2().read_text().splitlines()
    data.write_text("\n".join([lines[0], lines[1], lines[2].replace(",56,", ",150,", 1), lines[3]]) + "\n")
    preds = tmp_path / "preds.csv"
    code, out, err = _run(
        capsys, "predict", str(strict), "--dataset", f"csv:{data}", "--out", str(preds), "--json"
    )
    assert code == 0, err
    assert [r["row"] for r in csv.DictReader(preds.open())] == ["1", "3"]
    assert json.loads(out)["rows dropped by the schema's rules"] == 1
