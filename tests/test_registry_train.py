"""`veil train` charges the dataset's budget in the registry: composed totals, refusals before training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sqlalchemy")

from veil.accounting.ledger import Ledger
from veil.cli.main import main
from veil.registry.compose import spent_epsilon

# A small, fast run: logistic regression on digits, one epoch, no baseline.
FAST = ["--dataset", "digits", "--model", "logreg", "--epochs", "1", "--no-baseline", "--json"]


def _train(out: Path, epsilon: float, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    code = main(["train", *FAST, "--epsilon", str(epsilon), "--out", str(out)])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else {}), captured.err


def _show(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["budget", "show", "--dataset", "digits", "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    return status


def test_two_runs_show_the_composed_total_and_an_over_budget_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["budget", "set", "--dataset", "digits", "--epsilon", "1.6", "--delta", "1e-5"]) == 0
    capsys.readouterr()
    reports = []
    for name in ("first", "second"):
        code, report, err = _train(tmp_path / name, 1.0, capsys)
        assert code == 0, err
        reports.append(report)
    status = _show(capsys)
    ledgers = [Ledger.open(tmp_path / name / "ledger.jsonl").events() for name in ("first", "second")]
    expected = spent_epsilon(ledgers, 1e-5)
    assert status["spent_epsilon"] == pytest.approx(expected, rel=1e-9)  # what the two ledgers compose to
    assert status["spent_epsilon"] < sum(r["epsilon_spent"] for r in reports)  # composed, not added
    assert [r["status"] for r in status["runs"]] == ["committed", "committed"]
    assert status["remaining_epsilon"] == pytest.approx(1.6 - expected)

    # A third ε = 1 run cannot fit in what remains: refused before training, nothing written or recorded.
    code, _, err = _train(tmp_path / "third", 1.0, capsys)
    assert code == 2 and err.count("\n") == 1 and "over its budget" in err
    assert not (tmp_path / "third").exists()
    assert len(_show(capsys)["runs"]) == 2


def test_an_exhausted_dataset_is_refused_before_a_row_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = _train(tmp_path / "first", 0.5, capsys)
    assert code == 0, err
    assert main(["budget", "set", "--dataset", "digits", "--epsilon", "0.4", "--delta", "1e-5"]) == 0
    capsys.readouterr()

    def no_reading(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the data was read")

    import veil.training.run

    monkeypatch.setattr(veil.training.run, "prepare_run", no_reading)
    code, _, err = _train(tmp_path / "second", 0.1, capsys)
    assert code == 2 and "refused before any row was parsed" in err and "data was read" not in err
    assert not (tmp_path / "second").exists()


def test_a_declared_dataset_id_names_the_account(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    code = main(["train", *FAST, "--epsilon", "0.5", "--dataset-id", "clinic-2026", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["budget", "show", "--dataset-id", "clinic-2026", "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    assert status["dataset_id"] == "name:clinic-2026" and len(status["runs"]) == 1
    header = Ledger.open(out / "ledger.jsonl").header
    assert header["budget_dataset_id"] == "name:clinic-2026"
    assert header["budget_run_id"] == status["runs"][0]["run_id"]
