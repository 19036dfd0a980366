"""Adversarial review revH, H1: ``veil pate`` refuses nothing on N after reading and prints no N.

PATE treats N (the private examples or groups) as private: ``dataset.n_private`` is internal. It used
to refuse δ ≥ 1/N after reading the rows (``δ ≥ 1/N (N = 73 training examples)``), so between a table
D and its neighbour D' (one more record in the private part) the exit status, the run folder and the
message changed with one record, and the message printed the exact count; a 3-row table was refused
with "3 examples for 2 classes". Now δ against 1/N is a note in ``non_private.checks_on_n``; the
checklist (public, and ``release_ready`` depends on it) holds no check on N.

Planted: restore ``check_delta(cfg.delta, part.num_units)`` in :func:`veil.pate.run._partition` and
``test_delta_against_the_private_n_is_a_note_never_a_refusal`` fails (D' exits 2, printing N)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _budget_cli import cli
from veil.data import load_dataset
from veil.pate.config import make_pate_config


def _tables(folder: Path) -> tuple[Path, Path, int]:
    """D (N private examples) and D' = D + one row the keyed split puts in the private part."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    rows = [f"{r[0]:.4f},{r[1]:.4f},{r[2]:.4f},{int(r[0] > 0)}" for r in x]
    d, dp = folder / "D.csv", folder / "Dp.csv"
    d.write_text("a,b,c,label\n" + "\n".join(rows) + "\n")
    frac = make_pate_config({}).holdout_fraction

    def n(p: Path) -> int:
        spec = f"csv:{p}"
        return len(load_dataset(spec, target="label", classes=["0", "1"], test_fraction=frac, seed=0).y_train)

    n0 = n(d)
    for k in range(100):
        dp.write_text("a,b,c,label\n" + "\n".join([*rows, f"0.{k:02d}1,0.5,0.5,1"]) + "\n")
        if n(dp) == n0 + 1:
            return d, dp, n0
    raise AssertionError("no row on the private side")  # pragma: no cover


def _pate(capsys: pytest.CaptureFixture[str], data: Path, folder: Path, delta: float) -> tuple[int, str]:
    np.savez(folder / "pub.npz", x=np.random.default_rng(1).normal(size=(20, 3)))
    out = folder / f"out-{data.stem}"
    code, stdout, err = cli(
        capsys, "pate", "--dataset", f"csv:{data}", "--target", "label", "--classes", "0,1",
        "--public-data", str(folder / "pub.npz"), "--teachers", "3", "--sigma", "1", "--epsilon", "10",
        "--delta", repr(delta), "--queries", "5", "--out", str(out),
    )  # fmt: skip
    return code, stdout + err


def test_delta_against_the_private_n_is_a_note_never_a_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d, dp, n0 = _tables(tmp_path)
    delta = 1.0 / (n0 + 0.5)  # < 1/N for D, ≥ 1/N for D'
    code_d, text_d = _pate(capsys, d, tmp_path, delta)
    code_dp, text_dp = _pate(capsys, dp, tmp_path, delta)
    assert (code_d, code_dp) == (0, 0), text_d + text_dp
    assert f"N = {n0 + 1}" not in text_dp
    inner = json.loads((tmp_path / "out-Dp" / "report.json").read_text())
    assert any("1/N" in note for note in inner["non_private"]["checks_on_n"])
    assert json.loads((tmp_path / "out-D" / "report.json").read_text())["non_private"]["checks_on_n"] == []
    for name in ("out-D", "out-Dp"):
        public = json.loads((tmp_path / name / "release" / "report.json").read_text())
        assert "checks_on_n" not in json.dumps(public)
        assert [c["name"] for c in public["checks"]] == ["target_epsilon_kept", "secure_randomness"]


def test_a_table_of_three_rows_is_not_refused_on_its_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "three.csv"
    data.write_text("a,b,c,label\n0.1,0.2,0.3,0\n0.4,0.5,0.6,1\n0.7,0.8,0.9,0\n")
    code, text = _pate(capsys, data, tmp_path, 1e-3)
    assert code == 0, text
    assert "3 examples" not in text


def _idx(path: Path, a: np.ndarray) -> None:
    import struct

    path.write_bytes(bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes())


def test_a_built_in_name_on_the_users_files_refuses_nothing_on_n(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """revI I2: ``--dataset fashion-mnist --data-dir DIR`` reads the user's IDX files, whose count is
    private: 72 and 73 images at δ = 1/72.5 both release labels, and no message holds the count.
    Planted: the built-in refusal (``check_delta(cfg.delta, len(ds.y_train))``) makes 73 exit 2."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "pub.npz", x=rng.integers(0, 256, size=(12, 1, 28, 28)).astype(np.float32))
    outcomes = []
    for n in (72, 73):
        folder = tmp_path / f"idx{n}"
        folder.mkdir()
        for prefix, rows in (("train", n), ("t10k", 10)):
            _idx(
                folder / f"{prefix}-images-idx3-ubyte",
                rng.integers(0, 256, size=(rows, 28, 28), dtype=np.uint8),
            )
            _idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, size=rows, dtype=np.uint8))
        code, stdout, err = cli(
            capsys, "pate", "--dataset", "fashion-mnist", "--data-dir", str(folder),
            "--public-data", str(tmp_path / "pub.npz"), "--teachers", "3", "--sigma", "1",
            "--epsilon", "10", "--delta", repr(1 / 72.5), "--queries", "4",
            "--out", str(tmp_path / f"out{n}"),
        )  # fmt: skip
        outcomes.append(code)
        assert "N = " not in stdout + err and str(n) not in err, stdout + err
    assert outcomes == [0, 0]
