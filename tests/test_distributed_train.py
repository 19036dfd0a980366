"""``veil train --nproc-per-node 2``: a rank killed mid-run stops the run cleanly; ``--resume`` completes it
with every step in rank 0's ledger, and ``report.json`` says ``"world_size": 2``.

Subprocesses throughout (the launcher's agent runs in the ``veil train`` process); every wait is
bounded and any process left over is killed by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")
RUN_TIMEOUT_S = 300


def _env(tmp: Path) -> dict[str, str]:
    """The ranks' scratch folders (one left behind by the killed rank) and logs go under ``tmp``."""
    (tmp / "tmp").mkdir(exist_ok=True)
    pythonpath = SRC + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": pythonpath, "TMPDIR": str(tmp / "tmp")}


def _veil(*args: str) -> list[str]:
    return [sys.executable, "-m", "veil", *args]


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            found += [int(c) for c in children]
            frontier += [int(c) for c in children]
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _steps_in_ledger(out: Path) -> list[int]:
    ledger = out / "ledger.jsonl"
    if not ledger.exists():
        return []
    records = [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in records if r.get("kind") == "step"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")
def test_killed_rank_stops_the_run_and_resume_completes_it(tmp_path: Path) -> None:
    settings = tmp_path / "settings.toml"
    settings.write_text("epochs = 3\ncheckpoint_every = 2\nbaseline = false\n")
    out = tmp_path / "run"
    args = ["train", str(settings), "--dataset", "digits", "--epsilon", "3", "--nproc-per-node", "2"]
    first = subprocess.Popen(
        _veil(*args, "--out", str(out), "--json"),
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while killed is None and time.monotonic() < deadline and first.poll() is None:
            if len(_steps_in_ledger(out)) >= 4:  # mid-run: 4 of 18 steps charged
                ranks = {_rank_of(p): p for p in _descendants(first.pid)}
                if 1 in ranks:
                    os.kill(ranks[1], signal.SIGKILL)
                    killed = ranks[1]
            time.sleep(0.05)
        stdout, stderr = first.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if first.poll() is None:  # only while it runs: a reaped pid may belong to someone else
            for pid in _descendants(first.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            first.kill()
            first.communicate()
    assert killed is not None, stderr[-2000:]
    assert first.returncode == 2, stderr[-2000:]
    error_lines = [line for line in stderr.splitlines() if line.startswith("veil: error:")]
    assert len(error_lines) == 1 and "rank=1" in error_lines[0] and "--resume" in error_lines[0]
    assert stdout == ""  # nothing reported for an unfinished run
    assert not (out / "report.json").exists()
    charged_before = _steps_in_ledger(out)
    assert 4 <= len(charged_before) < 18

    second = subprocess.run(
        _veil("train", "--resume", str(out), "--nproc-per-node", "2", "--json"),
        env=_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    report = json.loads(second.stdout)
    assert report["world_size"] == 2
    assert report["resumes"] == 1
    # Every step charged exactly once, in order, before and after the interruption.
    steps = _steps_in_ledger(out)
    assert steps[: len(charged_before)] == charged_before
    assert steps == list(range(1, len(steps) + 1))
    assert report["steps"] == len(steps) + sum(
        1 for line in (out / "ledger.jsonl").read_text().splitlines() if '"kind":"recovered"' in line
    )
    assert report["steps"] == report["steps_planned"] == 18
    assert report["epsilon_spent"] <= report["target_epsilon"]
    assert json.loads((out / "report.json").read_text())["world_size"] == 2
