"""bench/tables.py still runs (tiny sizes; the figures themselves live in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_tables_bench_runs_and_reports_both_formats(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_tables", BENCH / "tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert module.main(["--rows", "2000", "--dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "| 2000 | csv |" in out and "| 2000 | parquet |" in out
    assert not (tmp_path / "b").exists()  # generated files are removed
