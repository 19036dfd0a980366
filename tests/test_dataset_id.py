"""``--dataset-id`` on every charged job (issue 23, item 5): one declared identity, one budget, whatever
file or format the rows are read from; over budget is refused before a row is read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from _budget_cli import cli
from test_registry_jobs import SYNTH_SCHEMA


def _show_id(capsys: pytest.CaptureFixture[str], dataset_id: str) -> dict:
    code, out, _ = cli(capsys, "budget", "show", "--dataset-id", dataset_id, "--json")
    assert code == 0
    return json.loads(out)["datasets"][0]


def _must_not_read(*_: object, **__: object) -> None:
    raise AssertionError("a private row was read")


SCHEMA = SYNTH_SCHEMA  # the same small table schema as the registry job tests


def test_synth_csv_and_parquet_under_one_id_are_one_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lines = ["age,city,label"] + [
        f"{rng.uniform(0, 100):.1f},{'abc'[rng.integers(0, 3)]},{'yes' if rng.random() < 0.4 else 'no'}"
        for _ in range(1200)
    ]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    table: pa.Table = pacsv.read_csv(tmp_path / "d.csv")
    pq.write_table(table, tmp_path / "d.parquet")
    (tmp_path / "schema.toml").write_text(SCHEMA)
    assert cli(capsys, "budget", "set", "--dataset-id", "people", "--epsilon", "2", "--delta", "1e-6")[0] == 0
    base = ["synth", "--dataset-id", "people", "--schema", str(tmp_path / "schema.toml"), "--delta", "1e-6",
            "--rows", "40", "--iterations", "30", "--bins", "4"]  # fmt: skip
    code, _, err = cli(capsys, *base, "--dataset", f"csv:{tmp_path / 'd.csv'}", "--epsilon", "1",
                       "--out", str(tmp_path / "s1"))  # fmt: skip
    assert code == 0, err
    status = _show_id(capsys, "people")
    assert status["dataset_id"] == "name:people" and status["jobs"] == {"synth": 1}
    # The same rows as Parquet, under the same id: the same budget, so ε = 2 more is refused before
    # a row is read (ε 1 and 2 compose to more than the budget 2), nothing written or charged.
    import veil.synth.run as synth_run

    monkeypatch.setattr(synth_run, "read_codes", _must_not_read)
    out = tmp_path / "s2"
    code, _, err = cli(capsys, *base, "--dataset", f"parquet:{tmp_path / 'd.parquet'}", "--epsilon", "2",
                       "--out", str(out))  # fmt: skip
    assert code == 2 and "budget" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert _show_id(capsys, "people")["jobs"] == {"synth": 1}


def test_pate_and_tune_are_charged_to_the_declared_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli(capsys, "budget", "set", "--dataset-id", "bc", "--epsilon", "8", "--delta", "1e-5")[0] == 0
    code, _, err = cli(capsys, "pate", "--dataset", "breast-cancer", "--dataset-id", "bc", "--teachers", "10",
                       "--sigma", "2", "--epsilon", "6", "--queries", "20", "--out", str(tmp_path / "p1"),
                       "--json")  # fmt: skip
    assert code == 0, err
    status = _show_id(capsys, "bc")
    assert status["jobs"] == {"pate": 1}
    # The fingerprint of the built-in data was not charged: the declared id was.
    code, out, _ = cli(capsys, "budget", "show", "--dataset", "breast-cancer", "--json")
    assert code == 0 and json.loads(out)["datasets"][0]["jobs"] == {}
    # Spend the rest: a budget equal to what is spent admits nothing, and tune and pate under the id
    # are refused before a row is read.
    spent = status["spent_epsilon"]
    code = cli(capsys, "budget", "set", "--dataset-id", "bc", "--epsilon", f"{spent}", "--delta", "1e-5")[0]
    assert code == 0
    import veil.pate.run as pate_run
    import veil.tune.run as tune_run

    monkeypatch.setattr(tune_run, "prepare_trial", _must_not_read)
    monkeypatch.setattr(pate_run, "load_pate_data", _must_not_read)
    code, _, err = cli(capsys, "tune", "--dataset", "breast-cancer", "--dataset-id", "bc", "--epsilon", "1",
                       "--tune-anyway", "--out", str(tmp_path / "t"))  # fmt: skip
    assert code == 2 and "budget" in err and not (tmp_path / "t").exists()
    code, _, err = cli(capsys, "pate", "--dataset", "breast-cancer", "--dataset-id", "bc", "--epsilon", "1",
                       "--out", str(tmp_path / "p2"))  # fmt: skip
    assert code == 2 and "budget" in err and not (tmp_path / "p2").exists()
    assert _show_id(capsys, "bc")["jobs"] == {"pate": 1}
