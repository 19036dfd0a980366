"""``veil federated`` stopped while it reserves or reads, outside Flower: a consistent state.

Two gaps (the last session's closing note): SIGTERM was turned into Ctrl-C only around Flower's
simulation engine, so a SIGTERM while the registry reserved the run or the data was read killed the
process with the run charged and no folder to continue it; and an interrupt that landed after the
registry's commit but before the reservation returned left the caller without the run id, so the
charged run got no folder either. Now :func:`veil.federated.run.sigterm_interrupts` covers the whole
charged block, and the run id is fixed before the registry is asked
(:meth:`veil.federated.charge.FederatedCharge.with_ids`; :meth:`~veil.federated.charge.FederatedCharge.holds`
says whether the registry recorded it): the one line that says how to continue, exit 130, the
folder's ``settings.json``, the reservation kept charged (never released), and ``--resume`` finishes
the run under the same record.

Planted: restore ``run.py``/``charge.py`` from before the fix (the run id set from the reservation's
return, SIGTERM handled inside Flower only) and both tests fail: the commit-window interrupt leaves
no folder (a bare "interrupted"), and the SIGTERM reaches the test's own handler."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr")

from _budget_cli import cli as _cli
from _budget_cli import show as _show
from _fake_grid import in_process_engine


def _args(out: Path, mode: str) -> list[str]:
    args = ["federated", "--dataset", "digits", "--model", "logreg", "--clients", "3", "--mode", mode,
            "--rounds", "2", "--epsilon", "8", "--delta", "1e-3", "--seed", "1",
            "--out", str(out)]  # fmt: skip
    return [*args, "--local-steps", "2"] if mode == "record-level" else args


def _resume_finishes(out: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import veil.federated.run as run

    (stopped,) = _show(capsys, "digits")["runs"]
    assert stopped["epsilon"] > 0  # charged: the stand-in or the plan, never released
    monkeypatch.setattr(run, "run_simulation_engine", in_process_engine)
    code, shown, err = _cli(capsys, "federated", "--resume", str(out), "--json")
    assert code == 0, err[-2000:]
    assert json.loads(shown.strip().splitlines()[-1])["guarantee"]["rounds_charged"] == 2
    (resumed,) = _show(capsys, "digits")["runs"]
    assert resumed["run_id"] == stopped["run_id"] and resumed["status"] == "committed"


@pytest.mark.parametrize("mode", ["client-level", "record-level"])
def test_an_interrupt_after_the_registry_commits_leaves_a_folder_naming_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    from veil.registry import transactions

    real = transactions.reserve

    def commit_then_interrupt(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt  # after the commit, before the reservation returns

    monkeypatch.setattr(transactions, "reserve", commit_then_interrupt)
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *_args(out, mode))
    assert (code, err) == (130, f"veil: interrupted; continue with: veil federated --resume {out}\n")
    assert (out / "settings.json").is_file() and not (out / "release").exists()
    (run,) = _show(capsys, "digits")["runs"]
    assert run["status"] == "reserved"  # charged as planned: never released
    monkeypatch.setattr(transactions, "reserve", real)
    _resume_finishes(out, capsys, monkeypatch)


class _SigtermReachedTheTest(Exception):
    pass


def test_sigterm_while_the_data_is_read_stops_as_ctrl_c_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.federated.run as run

    def guard(signum: int, frame: Any) -> None:  # veil's handler must be the one in force
        raise _SigtermReachedTheTest

    kept = run.check_data

    def sigterm(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, guard)
    try:
        monkeypatch.setattr(run, "check_data", sigterm)
        out = tmp_path / "fl"
        code, _, err = _cli(capsys, *_args(out, "client-level"))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (code, err) == (130, f"veil: interrupted; continue with: veil federated --resume {out}\n")
    assert (out / "settings.json").is_file()
    monkeypatch.setattr(run, "check_data", kept)
    _resume_finishes(out, capsys, monkeypatch)
