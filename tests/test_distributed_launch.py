"""The elastic-launcher entry point: N local copies of ``python -m veil ...`` under torchrun's machinery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from veil.distributed.launch import launch_local, launched_by_torchrun
from veil.errors import ConfigError, InvalidParameterError

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _script(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter (the launcher's agent changes process-wide state)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )


def test_launch_runs_every_rank_with_torchrun_environment(tmp_path: Path) -> None:
    body = "from veil.distributed.launch import launch_local\nlaunch_local(['env', '--json'], 2)\n"
    done = _script(body, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2  # one per rank


def test_a_failed_rank_stops_the_launch_with_one_error(tmp_path: Path) -> None:
    body = (
        "import sys\n"
        "from veil.distributed.launch import launch_local\n"
        "from veil.errors import ConfigError\n"
        "try:\n"
        "    launch_local(['no-such-command'], 2)\n"
        "except ConfigError as exc:\n"
        "    print('REFUSED', exc)\n"
        "    sys.exit(3)\n"
    )
    done = _script(body, tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "REFUSED rank=" in done.stdout and "--resume" in done.stdout


def test_launch_arguments_are_checked() -> None:
    with pytest.raises(InvalidParameterError, match="nproc_per_node"):
        launch_local(["env"], 0)
    assert ConfigError  # the failure type named in the module docstring


def test_torchrun_environment_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_torchrun()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_by_torchrun()


def test_what_cannot_run_across_ranks_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.cli.main import main
    from veil.distributed import runtime

    out = tmp_path / "run"
    code = main(["train", "--dataset", "digits", "--audit", "--nproc-per-node", "2", "--out", str(out)])
    assert code == 2
    assert "audit" in capsys.readouterr().err
    assert not out.exists()
    # A DP-released preprocessing statistic: refused in the job's preparation, before the run folder.
    runtime.refuse_private_preprocessing(public=False)  # one process: allowed
    monkeypatch.setattr(runtime, "rank_and_world", lambda: (0, 2))
    runtime.refuse_private_preprocessing(public=True)
    with pytest.raises(ConfigError, match="preprocessing"):
        runtime.refuse_private_preprocessing(public=False)
