"""``veil train --stream --privacy-unit COLUMN``: people protected while rows stay in the Parquet file.

The streamed scan keeps each training row's unit key beside its file position and splits by the
keyed hash of the unit (the in-memory rule); training uses the engine's own unit sampler wrapped in
the windowed reader. So a seeded streamed run is the in-memory unit run: same split, same units,
same draws, same weights (planted: the row-content split in the scan, or the row-level chunked
sampler in place of the unit sampler — each caught below).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from test_privacy_unit_train import SCHEMA, visits  # noqa: E402
from veil.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pyarrow.csv as pcsv

    folder = tmp_path_factory.mktemp("unit-stream")
    visits(folder / "visits.csv", people=150)
    (folder / "schema.toml").write_text(SCHEMA)
    pq.write_table(pcsv.read_csv(folder / "visits.csv"), folder / "v.parquet", row_group_size=100)
    return {"data": folder / "v.parquet", "schema": folder / "schema.toml"}


def test_the_streamed_scan_keeps_the_in_memory_units_and_split(table: dict[str, Path]) -> None:
    from veil.data import load_dataset
    from veil.tables.stream import ParquetRows, scan_parquet

    spec = f"parquet:{table['data']}"
    data = load_dataset(spec, schema=str(table["schema"]), seed=3, privacy_unit="patient_id")
    scan = scan_parquet(table["data"], data.encoder, 0.2, seed=3, unit_column="patient_id")
    assert scan.units is not None and data.units_train is not None
    np.testing.assert_array_equal(scan.units, data.units_train)
    x, y = ParquetRows(table["data"], data.encoder, scan.positions).fetch(np.arange(len(scan.positions)))
    np.testing.assert_array_equal(x, data.x_train)
    np.testing.assert_array_equal(y, data.y_train)
    assert scan.n_test == data.n_test


ARGS = ["--epochs", "2", "--epsilon", "3", "--delta", "1e-4", "--batch-size", "16", "--reproducible",
        "--json", "--privacy-unit", "patient_id", "--max-rows-per-unit", "3"]  # fmt: skip


def _train(table: dict[str, Path], out: Path, *extra: str) -> dict:
    code = main(
        ["train", "--dataset", f"parquet:{table['data']}", "--schema", str(table["schema"]),
         *ARGS, "--out", str(out), *extra]
    )  # fmt: skip
    assert code == 0
    return json.loads((out / "report.json").read_text())


def test_a_streamed_unit_run_is_the_in_memory_unit_run(
    table: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    streamed = _train(table, tmp_path / "s", "--stream", "--stream-rows", "60")
    memory = _train(table, tmp_path / "m", "--no-baseline")
    out, err = capsys.readouterr()
    assert "PATIENT-" not in out + err + (tmp_path / "s" / "report.json").read_text()
    for key in ("sampling_rate", "steps", "epsilon_spent", "noise_multiplier", "privacy_unit"):
        assert streamed[key] == memory[key], key
    assert streamed["privacy_unit"]["column"] == "patient_id"
    assert streamed["guarantee"]["neighbouring"] == "add_or_remove_one_unit"
    assert streamed["streaming"]["windows"] >= 2
    a = torch.load(tmp_path / "s" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_streamed_unit_column_missing_from_the_file_is_refused_before_reading(
    table: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import veil.tables.encoder as encoder

    def no_read(*_: object, **__: object) -> None:
        raise AssertionError("a row was read")

    monkeypatch.setattr(encoder.TableEncoder, "encode", no_read)
    out = tmp_path / "run"
    args = [a if a != "patient_id" else "person" for a in ARGS]
    code = main(["train", "--dataset", f"parquet:{table['data']}", "--schema", str(table["schema"]),
                 *args, "--stream", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "not a column" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_streamed_unit_run_resumes_after_a_crash(
    table: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit sampler's resume token passes through the windowed reader: a run stopped after its
    third step resumes and takes the planned steps over units. (Not bitwise equal to the
    uninterrupted run: a resumed row-level streamed run is not either; checked 2026-12-01.)"""
    from veil.accounting.ledger import Ledger
    from veil.pipeline import loop
    from veil.training import train

    def config(out: Path) -> dict:
        return {"dataset": f"parquet:{table['data']}", "table_schema": str(table["schema"]), "stream": True,
                "stream_rows": 60, "epochs": 2, "epsilon": 3.0, "delta": 1e-4, "batch_size": 16,
                "privacy_unit": "patient_id", "max_rows_per_unit": 3, "reproducible": True,
                "checkpoint_every": 2, "out": str(out), "progress": False}  # fmt: skip

    whole = train(config(tmp_path / "whole"))
    real, calls = loop.update_ema, []

    def crash(*args: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # after the third step's update, before its checkpoint
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "update_ema", crash)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "r"))
    monkeypatch.setattr(loop, "update_ema", real)
    Ledger.open(tmp_path / "r" / "ledger.jsonl", repair=True).close()
    resumed = train(resume=tmp_path / "r", progress=False)
    assert resumed.resumes == 1 and resumed.steps == whole.steps == resumed.steps_planned
    assert resumed.streaming is not None
    assert resumed.to_dict()["privacy_unit"] == whole.to_dict()["privacy_unit"]
