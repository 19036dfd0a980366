"""Adversarial review revJ, J4 (PATE part): zero training rows take the path of one.

PATE's N is private, and the keyed train/test split may hold every row out. ``veil pate`` on such a
table (D: a header and one row the split holds out) crashed after the charge with a traceback
(``_canonical_rows`` reshaped a 0-row array), while its neighbour D' (one more row, on the training
side) released labels: whether anything was released depended on one record. Now every teacher
abstains on N = 0 and the aggregator still answers (its noise alone), charged and released as for any
N, with the same report shape and the same printed lines.

Planted (each seen to fail): restore ``a.reshape(a.shape[0] if a.ndim else 0, -1)`` in
:func:`veil.pate.partition._canonical_rows` and ``test_rows_of_no_example_hash_to_nothing`` and
``test_the_neighbours_release_alike`` fail (D: ValueError); restore ``if acc is not None`` in
``veil.cli.pate._summary`` and ``test_an_empty_test_side_still_names_its_student`` fails (as it does
when the summary prints ``report['guarantee']``, the guarantee object, instead of its name).

The header-only CSV and its neighbour with one training row: ``test_a_header_only_csv_releases_like_one_row``
(``veil.data.tabular`` reads zero rows without a refusal since fixo; restoring its "a CSV needs a header
row and at least one data row" refusal fails it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sklearn")

from _budget_cli import cli, show
from veil.pate.partition import count_shared_rows, row_digests

HEADER = "a,b,c,d,y\n"
TEST_ROW = "2.041,-2.556,0.418,-0.568,0\n"  # the keyed split (seed 0) holds it out
TRAIN_ROW = "-0.216,-2.020,-0.232,-0.865,0\n"  # the keyed split puts it on the training side


@pytest.mark.parametrize("shape", [(0,), (0, 4), (0, 1, 8, 8)])
def test_rows_of_no_example_hash_to_nothing(shape: tuple[int, ...]) -> None:
    empty = np.zeros(shape, dtype=np.float32)
    assert row_digests(empty) == []
    assert count_shared_rows(empty, np.ones((3, *shape[1:]), dtype=np.float32)) == 0


def _shape(value: Any, path: str = "") -> set[str]:
    """Every key path of a JSON value (list items merged), without the values."""
    if isinstance(value, dict):
        return {path} | {p for k, v in value.items() for p in _shape(v, f"{path}/{k}")}
    if isinstance(value, list):
        return {path} | {p for v in value for p in _shape(v, f"{path}[]")}
    return {path}


def _pate(capsys: pytest.CaptureFixture[str], folder: Path, name: str, *extra: str) -> tuple[int, str, str]:
    out = folder / f"out-{name}"
    code, stdout, err = cli(
        capsys, "pate", "--dataset", f"csv:{folder / name}.csv", "--target", "y", "--classes", "0,1",
        "--public-data", str(folder / "pub.npz"), "--teachers", "5", "--epsilon", "8", "--sigma", "5",
        "--delta", "1e-5", "--workers", "1", "--queries", "12", "--out", str(out), *extra,
    )  # fmt: skip
    return code, stdout, err


def _write(folder: Path, **tables: str) -> None:
    np.savez(folder / "pub.npz", x=np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32))
    for name, rows in tables.items():
        (folder / f"{name}.csv").write_text(HEADER + rows)


def _masked(text: str, folder: Path) -> str:
    """The printed lines without figures, and without whether the noisy aggregator answered a query
    (confident-GNMax: the noise alone decides that for N = 0 as for N = 1, so either neighbour may
    print either clause)."""
    text = re.sub(r"[0-9]+(\.[0-9]+)?", "#", text.replace(str(folder), "<tmp>").replace("-Dp", "-D"))
    return text.replace("no student (no label released)", "<student>").replace(
        "student test accuracy # (non-private, internal)", "<student>"
    )


# Confident-GNMax with a threshold no noisy count of 5 teachers reaches: nothing answered on either
# side, deterministically (at threshold 3 the noise alone decided whether a student was trained, on D
# and D' alike, so the two reports' shapes differed at random).
@pytest.mark.parametrize(
    "extra",
    [(), ("--aggregator", "confident-gnmax", "--threshold", "60", "--sigma1", "2", "--budget", "ptr")],
    ids=["gnmax", "confident-ptr"],
)
def test_the_neighbours_release_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    """D (no training row) and D' (one): both exit 0 with labels and a student released (or, where
    the aggregator answers nothing, neither), reports of one shape, charged, and the same printed
    lines but for the figures; no traceback, no count."""
    _write(tmp_path, D=TEST_ROW, Dp=TEST_ROW + TRAIN_ROW)
    runs = {name: _pate(capsys, tmp_path, name, *extra) for name in ("D", "Dp")}
    for name, (code, stdout, err) in runs.items():
        assert code == 0 and err == "", (name, stdout, err)
        assert (tmp_path / f"out-{name}" / "release" / "report.json").is_file()
        assert "labels.npz" in {p.name for p in (tmp_path / f"out-{name}" / "release").iterdir()}
        assert [r["job"] for r in show(capsys, f"csv:{tmp_path / name}.csv")["runs"]] == ["pate"]
    assert _masked(runs["D"][1], tmp_path) == _masked(runs["Dp"][1], tmp_path)
    for report in ("report.json", "release/report.json"):
        d, dp = (json.loads((tmp_path / f"out-{n}" / report).read_text()) for n in ("D", "Dp"))
        assert _shape(d) == _shape(dp), report
    assert sorted(p.name for p in (tmp_path / "out-D" / "release").iterdir()) == sorted(
        p.name for p in (tmp_path / "out-Dp" / "release").iterdir()
    )
    inner = json.loads((tmp_path / "out-D" / "report.json").read_text())
    assert inner["non_private"]["checks_on_n"] == []  # N = 0: no 1/N to compare δ with


def test_an_empty_test_side_still_names_its_student(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """T: one row, on the training side, none held out: a student is released and the line says its
    test accuracy is none, not that there is no student."""
    _write(tmp_path, T=TRAIN_ROW)
    code, stdout, err = _pate(capsys, tmp_path, "T")
    assert code == 0, err
    assert (tmp_path / "out-T" / "release" / "student.model").is_file()
    assert "student test accuracy none (no held-out row)" in stdout
    assert "no student" not in stdout and "{" not in stdout  # the guarantee by name, not a dict


def test_a_header_only_csv_releases_like_one_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """H (the header alone) and its neighbour H' (one training row): both exit 0, charged, labels
    released, reports of one shape (a header-only file was refused after the charge)."""
    _write(tmp_path, H="", Hp=TRAIN_ROW)
    runs = {name: _pate(capsys, tmp_path, name) for name in ("H", "Hp")}
    for name, (code, stdout, err) in runs.items():
        assert code == 0 and err == "", (name, stdout, err)
        assert "labels.npz" in {p.name for p in (tmp_path / f"out-{name}" / "release").iterdir()}
        assert [r["job"] for r in show(capsys, f"csv:{tmp_path / name}.csv")["runs"]] == ["pate"]
    d, dp = (json.loads((tmp_path / f"out-{n}" / "release" / "report.json").read_text()) for n in ("H", "Hp"))
    assert _shape(d) == _shape(dp)
