"""``veil synth`` treats the row count N as private: nothing after reading refuses on it or prints it
(review revA, finding 4).

The checks that need the exact N (δ against 1/N, the 1-way noise against N) are notes in the internal
report's ``non_private`` section (:func:`veil.synth.run.checks_on_n`); neighbouring tables on either
side of δ = 1/N get the same exit status, the same kind of output and no N in any message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from veil.cli.main import main
from veil.synth.run import checks_on_n

SCHEMA = """
reviewed = true
[columns.a]
type = "ordinal"
levels = ["0", "1", "2", "3", "4"]
[columns.y]
role = "target"
classes = ["0", "1"]
"""


def _tables(folder: Path) -> tuple[Path, Path]:
    """The reviewer's pair: 1000 rows, and the same less its last row."""
    rng = np.random.default_rng(0)
    rows = ["a,y"] + [f"{rng.integers(0, 5)},{rng.integers(0, 2)}" for _ in range(1000)]
    (folder / "D.csv").write_text("\n".join(rows) + "\n")
    (folder / "Dprime.csv").write_text("\n".join(rows[:-1]) + "\n")
    return folder / "D.csv", folder / "Dprime.csv"


def test_neighbours_across_one_over_n_get_the_same_treatment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.toml").write_text(SCHEMA)
    outcomes = []
    for table in _tables(tmp_path):
        out = tmp_path / f"out_{table.stem}"
        argv = ["synth", "--dataset", f"csv:{table}", "--schema", str(tmp_path / "s.toml"), "--rows", "100",
                "--epsilon", "1", "--delta", "1e-3", "--iterations", "30", "--out", str(out)]  # fmt: skip
        code = main(argv)
        captured = capsys.readouterr()
        said = captured.out + captured.err
        assert not re.search(r"\b(1000|999)\b", said), said  # the exact N is in no message
        outcomes.append((code, out))
    assert [code for code, _ in outcomes] == [0, 0]
    notes = []
    for _, out in outcomes:
        for name in ("report.json", "report.html"):
            text = (out / "release" / name).read_text()
            assert "checks_on_n" not in text and "1/N" not in text
        notes.append(json.loads((out / "report.json").read_text())["non_private"]["checks_on_n"])
    # The internal report says what the exact N implies, for the operator only.
    assert len(notes[0]) == 1 and "δ = 0.001 ≥ 1/N (N = 1000" in notes[0][0]
    assert notes[1] == []


def test_checks_on_n_against_the_closed_conditions() -> None:
    assert checks_on_n(1e-3, 5.0, 999) == []
    (delta_note,) = checks_on_n(1e-3, 5.0, 1000)
    assert "1/N (N = 1000" in delta_note
    (noise_note,) = checks_on_n(1e-6, 1000.0, 1000)
    assert "noise of std 1e+03" in noise_note
    assert checks_on_n(1e-6, 999.9, 1000) == []
