"""Crash safety: ``veil train`` killed with SIGKILL in the middle of training, then resumed.

A *witness* model (below) appends one line to a file at every training forward pass of the DP run,
i.e. for every step that started computing an update. The ledger must be written (and fsync'ed)
before that, so after any kill the ledger's step count is at least the number of witness lines:
a ledger written after the step, or lost on a crash, would fail this test. The kill is a fault
injection, not a timer: the witness SIGKILLs its own process at its k-th training forward (k set
per attempt through ``VEIL_TEST_KILL_AT``), so the test is deterministic and never sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from veil.accounting.ledger import Ledger

WITNESS_ENV = "VEIL_TEST_WITNESS"
KILL_ENV = "VEIL_TEST_KILL_AT"


class _Witness(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A DP training step's forward: training mode, gradients on, float32, non-empty batch. (The
        # float64 clipping check and the engine's no_grad probe are not steps.)
        if (
            self.training
            and torch.is_grad_enabled()
            and x.dtype == torch.float32
            and len(x)
            and WITNESS_ENV in os.environ
        ):
            with open(os.environ[WITNESS_ENV], "a") as fh:
                fh.write(f"{os.getpid()}\n")
            self.forwards += 1
            if str(self.forwards) == os.environ.get(KILL_ENV):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after the forward, before its update
        return self.net(x)


def witness_model(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``--model test_crash_safety:witness_model``: logistic regression that logs its training forwards."""
    return _Witness(nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes)))


ARGS = [
    "train", "--model", "test_crash_safety:witness_model", "--epochs", "12", "--batch-size", "64",
    "--epsilon", "3", "--no-baseline", "--json",
]  # fmt: skip


def _start(out: Path, witness: Path, resume: bool, kill_at: int | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env[WITNESS_ENV] = str(witness)
    env.pop(KILL_ENV, None)
    if kill_at is not None:
        env[KILL_ENV] = str(kill_at)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    code = "import sys; from veil.cli.main import main; sys.exit(main(sys.argv[1:]))"
    args = [*ARGS, "--resume", str(out)] if resume else [*ARGS, "--out", str(out)]
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _witnessed(witness: Path) -> int:
    return len(witness.read_text().splitlines()) if witness.exists() else 0


def test_sigkill_mid_training_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    witness = tmp_path / "witness.txt"
    kills = 0
    for attempt, kill_at in enumerate((5, 31, 2)):  # the k-th training forward of each process
        resume = attempt > 0 and (out / "ledger.jsonl").exists()
        proc = _start(out, witness, resume=resume, kill_at=kill_at)
        before = _witnessed(witness)
        proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, "the run ended before its injected kill"
        kills += 1
        assert _witnessed(witness) - before == kill_at  # it died exactly at the injected step
        ledger = Ledger.open(out / "ledger.jsonl", repair=True)
        ledger.close()
        # Every step that started computing an update is charged in the ledger.
        assert ledger.steps >= _witnessed(witness)
    assert kills == 3
    proc = _start(out, witness, resume=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    report = json.loads(stdout)
    ledger = Ledger.open(out / "ledger.jsonl")
    assert report["steps"] == ledger.steps >= _witnessed(witness)
    assert report["steps"] == report["steps_planned"]  # the whole planned run, crashes included
    assert report["epsilon_spent"] <= report["target_epsilon"]
    assert report["resumes"] >= 1 and all(c["passed"] for c in report["checks"])
    state = torch.load(out / "model.pt", weights_only=True)
    restored = nn.Sequential()
    from veil.config import make_config
    from veil.data import load_dataset
    from veil.data.preprocess import build_transform, plan_preprocessing

    data = load_dataset("digits", seed=0)
    restored.add_module(
        "preprocess", build_transform(plan_preprocessing(make_config({}), data), data.input_shape)
    )
    restored.add_module("net", witness_model(data.input_shape, data.num_classes))
    restored.load_state_dict(state)  # a complete model: every weight present
    assert all(torch.isfinite(v).all() for k, v in state.items() if k.startswith("net."))
