"""The no-schema CSV/npz loader refuses no count after reading (fixm's "noticed and left alone").

:func:`veil.data.tabular._from_columns` refused a header-only file ("the file has no data rows") and
a table with too few rows left once the rows with a non-numeric cell were dropped ("too few rows are
left"): both after the rows were read, and both on a count that one record moves. Now such a table
goes on with zero (or a few) rows through the same path as any other; the job's rule on its public N
decides (``veil train``: N = 0 refused naming N = 0 only, as for a keyed split that left the training
side empty). An empty ``.npz`` archive crashed (a reshape of zero rows) and now takes the same path.

Planted: restore the ``not columns[target]`` refusal and ``test_a_header_only_file_loads_as_zero_rows``
fails; restore the "too few rows" refusal and ``test_rows_dropped_by_the_rule_leave_a_smaller_table``
fails; restore ``reshape(len(x), -1)`` in ``_load_npz`` and ``test_train_on_no_rows_names_only_n``
fails (npz: a traceback, exit 1)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from _budget_cli import cli
from veil.data.tabular import load_user


def test_a_header_only_file_loads_as_zero_rows(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("a,b,label\n")
    data = load_user(
        "csv", str(tmp_path / "d.csv"), target="label", test_fraction=0.2, seed=0, classes=["0", "1"]
    )
    assert (len(data.y_train), len(data.y_test)) == (0, 0) and data.x_train.shape == (0, 2)


def test_rows_dropped_by_the_rule_leave_a_smaller_table(tmp_path: Path) -> None:
    """Every row but one holds a text cell: dropped (a per-record rule), the rest goes on."""
    (tmp_path / "d.csv").write_text("a,b,label\nx,1,0\ny,2,1\nz,3,0\n1,2,1\n")
    data = load_user(
        "csv", str(tmp_path / "d.csv"), target="label", test_fraction=0.0, seed=0, classes=["0", "1"]
    )
    assert len(data.y_train) + len(data.y_test) == 1
    assert data.rules  # the drop is listed


@pytest.mark.parametrize("kind", ["header-only csv", "all rows dropped", "empty npz"])
def test_train_on_no_rows_names_only_n(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    if kind == "empty npz":
        np.savez(tmp_path / "d.npz", x=np.zeros((0, 3), np.float32), y=np.zeros(0, np.int64))
        spec = f"npz:{tmp_path / 'd.npz'}"
    else:
        rows = "" if kind == "header-only csv" else "x,1,0\ny,2,1\nz,3,0\n"
        (tmp_path / "d.csv").write_text("a,b,label\n" + rows)
        spec = f"csv:{tmp_path / 'd.csv'}"
    code, out, err = cli(
        capsys, "train", "--dataset", spec, "--target", "label" if spec.startswith("csv") else "y",
        "--classes", "0,1", "--model", "logreg", "--epsilon", "1", "--delta", "1e-2", "--no-baseline",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2, out + err
    assert err.count("\n") == 1 and "N = 0" in err and "Traceback" not in err, err
    assert re.findall(r"\d+", err.replace(str(tmp_path), "")) == ["0"], err  # no count but N = 0
