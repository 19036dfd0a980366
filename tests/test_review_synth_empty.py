"""Adversarial review revH, H4/H13/H5: N = 0 flows through the jobs whose N is private.

``veil synth`` treats N as private, yet an empty table (or one emptied by a per-record drop) was
refused after reading with "the table has no data rows" while its one-row neighbour released a table
(H4); with ``--privacy-unit`` and no row holding an id, ``checks_on_n`` divided by N = 0 (a traceback,
H13). ``veil schema infer --epsilon`` refused an empty table with its own message and charge, where one
row took the release path (H5). Now zero rows take the path of one row.

Planted: restore the ``n == 0`` refusal in :meth:`veil.tables.encoder.TableEncoder.encode_batches`
and ``test_synth_releases_on_an_empty_table_as_on_its_one_row_neighbour`` fails (exit 2 for D and D'');
drop the ``n < 1`` guard of :func:`veil.pipeline.data.delta_note` and
``test_synth_with_no_unit_releases`` fails (ZeroDivisionError); restore the count refusal in
``veil.tables.infer._Columns`` and ``test_schema_infer_takes_one_path_for_zero_and_one_row`` fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _budget_cli import cli, show
from veil.pipeline.data import delta_note
from veil.synth.run import checks_on_n

pytest.importorskip("sqlalchemy")

SCHEMA = """reviewed = true
[columns.age]
type = "numeric"
bounds = [0, 100]
[columns.city]
type = "categorical"
levels = ["a", "b"]
[columns.label]
role = "target"
classes = ["0", "1"]
"""

UNIT_SCHEMA = """reviewed = true
[columns.pid]
type = "ignored"
[columns.a]
type = "numeric"
bounds = [-1, 1]
[columns.label]
role = "target"
classes = ["0", "1"]
"""


def _synth(capsys: pytest.CaptureFixture[str], folder: Path, name: str, *extra: str) -> tuple[int, str]:
    code, out, err = cli(
        capsys, "synth", "--dataset", f"csv:{folder / name}.csv", "--schema", str(folder / "schema.toml"),
        "--epsilon", "1", "--delta", "1e-6", "--rows", "20", "--bins", "4",
        "--out", str(folder / f"out-{name}"), *extra,
    )  # fmt: skip
    return code, out + err


def test_synth_releases_on_an_empty_table_as_on_its_one_row_neighbour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    (tmp_path / "D.csv").write_text("age,city,label\n")
    (tmp_path / "Dp.csv").write_text("age,city,label\n37,a,1\n")
    (tmp_path / "Dq.csv").write_text("age,city,label\n37,a,7\n")  # a label outside the classes: dropped
    for name in ("D", "Dp", "Dq"):
        code, text = _synth(capsys, tmp_path, name)
        assert code == 0, text
        assert (tmp_path / f"out-{name}" / "release" / "synthetic.csv").is_file()
        assert "no data rows" not in text


def test_synth_with_no_unit_releases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "schema.toml").write_text(UNIT_SCHEMA)
    (tmp_path / "D.csv").write_text("pid,a,label\n,0.5,1\n,-0.2,0\nNA,0.1,1\n")  # no row has an id
    code, text = _synth(capsys, tmp_path, "D", "--privacy-unit", "pid")
    assert code == 0, text
    assert "Traceback" not in text
    report = json.loads((tmp_path / "out-D" / "report.json").read_text())
    assert not any("1/N" in note for note in report["non_private"]["checks_on_n"])


def test_checks_on_n_takes_n_zero() -> None:
    assert delta_note(0.5, 0) is None
    assert any("noise" in note for note in checks_on_n(1e-6, 3.0, 0))


def test_schema_infer_takes_one_path_for_zero_and_one_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "D.csv").write_text("age,label\n")
    (tmp_path / "Dp.csv").write_text("age,label\n37,1\n")
    results = []
    for name in ("D", "Dp"):
        spec = f"csv:{tmp_path / name}.csv"
        code, _, err = cli(capsys, "schema", "infer", spec, "--target", "label", "--epsilon", "1",
                           "--out", str(tmp_path / f"{name}.toml"))  # fmt: skip
        runs = show(capsys, spec)["runs"]
        results.append((code, err.split(": ", 2)[-1], [run["epsilon"] for run in runs]))
    assert results[0] == results[1], results
