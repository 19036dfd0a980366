"""The benchmark scripts still run against the library (tiny settings; what they measure is not checked
here: performance and utility numbers live in docs/benchmarks.md, measured by hand)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their shared helpers as `common`
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_audit_bench_runs_with_a_fixed_front_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    bench = _load("audit", monkeypatch)
    args = ["--model", "rff", "--epsilons", "3", "--shadow-models", "2", "--repeats", "1", "--canaries", "20"]
    args += ["--threads", str(torch.get_num_threads())]  # the script sets it process-wide
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "| 3 | 0 | 3.000 |" in out  # target ε, seed, accountant ε


def test_utility_bench_takes_config_overrides(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = _load("utility", monkeypatch)
    args = ["--datasets", "digits", "--seeds", "0", "--no-baseline", "--out", str(tmp_path)]
    assert bench.main([*args, "--set", "model='logreg'", "--set", "epochs=1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert "| logreg |" in row and "6 × q=" in row  # one epoch of logistic regression, as set
    with pytest.raises(SystemExit):
        bench.main([*args, "--set", "no-equals-sign"])


def test_synth_bench_runs_veil_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pyarrow")
    bench = _load("synth", monkeypatch)
    args = ["--epsilons", "3", "--seeds", "0", "--mechanisms", "mst", "--bins", "4", "--no-smartnoise"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "| veil mst | 3 |" in out and "| train on real |" in out
    assert bench.main([*args, "--domain", "data"]) == 0  # the mechanism on the codes present in the rows
    out = capsys.readouterr().out
    assert "| veil mst | 3 |" in out and "data domain" in out


def test_opacus_example_settings_bench_runs_one_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("opacus")  # a benchmark peer, installed by the test and bench extras
    import torch

    from test_data import _write_idx_folder  # tiny random IDX files: CI has no Fashion-MNIST

    _write_idx_folder(tmp_path / "idx", compress=True, n_train=64, n_test=20)
    bench = _load("opacus_mnist_settings", monkeypatch)
    out = tmp_path / "rows.jsonl"
    args = ["--epsilons", "3", "--epochs", "1", "--data-dir", str(tmp_path / "idx"), "--out", str(out)]
    args += ["--threads", str(torch.get_num_threads())]  # the script sets it process-wide
    assert bench.main(args) == 0  # 64 images at the example's batch 64: one Poisson step
    assert "| 3 | 1 |" in capsys.readouterr().out
    row = json.loads(out.read_text())
    assert row["settings"].startswith("REDUCED") and abs(row["epsilon_spent"] - 3.0) < 0.05
    assert row["train_size"] == 64 and 0.0 <= row["test_accuracy"] <= 1.0
    assert bench.main([*args, "--non-private"]) == 0  # the example's --disable-dp reference, labelled
    assert "| non-private | 1 | – | ∞ (not private) |" in capsys.readouterr().out
    assert bench.main(["--table", str(out)]) == 0  # the table of collected rows, without training
    assert "| 3 | 1 |" in capsys.readouterr().out


def test_conv_rule_bench_runs_and_checks_both_forms_agree(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    bench = _load("conv_rule", monkeypatch)
    # the script checks that the two per-sample forms agree before it times them
    assert bench.main(["--rounds", "1", "--shapes", "3", "--threads", str(torch.get_num_threads())]) == 0
    out = capsys.readouterr().out
    assert "| 256 × 1→32, 28×28 | patch matmul | patch matmul |" in out
    assert "| 256 × 1→8, 28×28 | grouped convolution | grouped convolution + bias sum |" in out
