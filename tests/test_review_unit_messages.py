"""Adversarial review of issue 24: a refusal after reading prints no row count of a unit run.

With a privacy unit only the number of units is public by declaration; the number of rows depends on
how many rows each person has (the report labels ``dataset.n_train`` non-private for that reason).
A table holding one person with 13 (or 3) rows made the split's refusal print "13 rows" / "13
examples", and the label check "3 examples for 2 classes": one person's row count, in plain text.
Planted: restore ``f"{len(y)} rows"`` in :func:`veil.data.split_by_unit` and this test fails. (Since
revH H10 neither side of the split is refused: the person on the training side trains, and on the
test side N = 0 is refused by N alone.)"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from _budget_cli import cli as _cli  # noqa: E402
from test_privacy_unit_train import SCHEMA  # noqa: E402


def _one_person(folder: Path, rows: int) -> str:
    path = folder / f"one-{rows}.csv"
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["patient_id", "a", "b", "outcome"])
        for i in range(rows):
            writer.writerow(["PATIENT-7", f"{i / 10:.1f}", "0.5", "yes" if i % 2 else "no"])
    return str(path)


@pytest.mark.parametrize(("rows", "stream"), [(13, False), (13, True), (3, False)])
def test_a_unit_runs_refusal_after_reading_prints_no_row_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: int, stream: bool
) -> None:
    spec = f"csv:{_one_person(tmp_path, rows)}"
    if stream:
        import pyarrow.csv as pcsv

        pq.write_table(pcsv.read_csv(spec[4:]), tmp_path / "one.parquet")
        spec = f"parquet:{tmp_path / 'one.parquet'}"
    (tmp_path / "schema.toml").write_text(SCHEMA)
    args = ["train", "--dataset", spec, "--schema", str(tmp_path / "schema.toml"), "--privacy-unit",
            "patient_id", "--batch-size", "1", "--epochs", "1", "--epsilon", "1", "--delta", "1e-4",
            "--no-baseline", "--out", str(tmp_path / "run"), *(["--stream"] if stream else [])]  # fmt: skip
    code, out, err = _cli(capsys, *args)
    # the one person's side of the keyed split decides: an empty test side trains (no test metric,
    # revH H10), an empty training side is refused naming N = 0 only; never a row count either way
    assert code in (0, 2), out + err
    assert re.search(rf"\b{rows}\b", out + err) is None, err  # the person's row count
    assert "PATIENT" not in out + err
