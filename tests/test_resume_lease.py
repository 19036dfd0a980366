"""A run is continued by one copy of its folder, never from an older ledger, and an interrupt keeps the
plan charged (revD's F1 and F7; :mod:`veil.registry.resume_lease`).

``veil train`` on digits, interrupted after its third update (the same hook as the streaming tests),
then resumed through the CLI as a user would (``veil train --resume``): exit 2 and one line for a
refused folder, the registry's record unchanged, nothing trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import veil.training.run as training_run
from _budget_cli import cli, show
from veil.registry.resume_lease import ResumeLease

ARGS = ["--dataset", "digits", "--epsilon", "2", "--epochs", "2", "--batch-size", "128", "--no-baseline"]


def _no_read(*args: object, **kwargs: object) -> None:
    raise AssertionError("the private data was read before the refusal")


def _interrupted_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    from veil.pipeline import loop

    real, calls = loop.update_ema, []

    def stop(*args: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # after the third step's update
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "update_ema", stop)
    code, _, err = cli(capsys, "train", *ARGS, "--out", str(out))
    monkeypatch.setattr(loop, "update_ema", real)
    assert code == 130, err


def test_an_interrupt_keeps_the_plan_charged_and_the_resume_settles_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """F7: the interrupt may follow the noiseless loss on the progress bar, so the registry does not
    learn when it came: the run stays charged at its whole plan (ε = 2), not at its three steps."""
    _interrupted_run(capsys, monkeypatch, tmp_path / "run")
    (stopped,) = show(capsys, "digits")["runs"]
    assert stopped["epsilon"] == pytest.approx(2.0, rel=1e-3)
    code, out, err = cli(capsys, "train", "--resume", str(tmp_path / "run"), "--json")
    assert code == 0, err
    (finished,) = show(capsys, "digits")["runs"]
    assert finished["run_id"] == stopped["run_id"] and finished["epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert json.loads(out)["resumes"] == 1


def test_a_copy_of_a_folder_another_copy_resumed_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """F1: two copies of one interrupted folder would each train the rest of the run with fresh noise
    under one charge; the second to resume is refused, before anything trains or is charged."""
    _interrupted_run(capsys, monkeypatch, tmp_path / "run")
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    code, _, err = cli(capsys, "train", "--resume", str(tmp_path / "run"), "--json")
    assert code == 0, err
    before = show(capsys, "digits")
    monkeypatch.setattr(training_run, "prepare_run", _no_read)  # refused before a row is read (revE)
    code, out, err = cli(capsys, "train", "--resume", str(tmp_path / "copy"), "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "another copy of this run folder" in err
    assert show(capsys, "digits") == before
    assert not (tmp_path / "copy" / "model.pt").exists()


def test_an_older_ledger_of_a_finished_run_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """F1's variant: every prefix of the unkeyed hash chain is a valid ledger, so a finished run's
    ledger cut to its header (checkpoints removed) looked like a run to train again for no charge."""
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *ARGS, "--out", str(run))
    assert code == 0, err
    before = show(capsys, "digits")
    ledger = run / "ledger.jsonl"
    ledger.write_text(ledger.read_text().splitlines()[0] + "\n")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    (run / "model.pt").unlink()
    monkeypatch.setattr(training_run, "prepare_run", _no_read)
    code, _, err = cli(capsys, "train", "--resume", str(run), "--json")
    assert code == 2 and "older than the one the run was settled with" in err, err
    assert show(capsys, "digits") == before
    assert not (run / "model.pt").exists()


def test_the_registry_checks_and_advances_the_lease_in_one_step(tmp_path: Path) -> None:
    """The rule itself, on the registry: generation 0 → 1 → 2 along one folder's resumes; a claim of
    an overtaken generation or of a shorter ledger than the one settled is refused, nothing changed."""
    from veil.accounting.events import Laplace
    from veil.errors import RegistryError
    from veil.registry import transactions
    from veil.registry.store import BudgetRegistry

    plan = [Laplace(0.5)]
    with BudgetRegistry(tmp_path / "b.db") as registry:
        registry.set_budget("name:toy", 10.0, 1e-6)
        registry.reserve("name:toy", plan, "r1", delta=1e-6)
        transactions.commit(registry.db, "r1", plan, ledger_records=10)
        with pytest.raises(RegistryError, match="older than"):
            transactions.reopen(registry.db, "r1", plan, ResumeLease(0, 9))
        assert registry.run("r1").status == "committed"  # refused: nothing changed
        transactions.reopen(registry.db, "r1", plan, ResumeLease(0, 10))
        assert registry.run("r1").status == "reserved"
        transactions.commit(registry.db, "r1", plan, ledger_records=12)
        with pytest.raises(RegistryError, match="another copy"):
            transactions.reopen(registry.db, "r1", plan, ResumeLease(0, 12))  # overtaken
        transactions.reopen(registry.db, "r1", plan, ResumeLease(1, 12))
        transactions.commit(registry.db, "r1", plan, ledger_records=5)  # never lowered
        with pytest.raises(RegistryError, match="older than"):
            transactions.reopen(registry.db, "r1", plan, ResumeLease(2, 11))
