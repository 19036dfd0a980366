"""Two processes through Lightning's DDP strategy on gloo: both ranks end with identical weights, and
the run is charged once per step (by rank 0), as ``veil train --nproc-per-node`` is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from veil.accounting.calibrate import dpsgd_event, epsilon_of
from veil.accounting.events import SelfComposed
from veil.registry.charge import open_registry
from veil.registry.identity import dataset_identity

HERE = Path(__file__).parent


def test_two_ranks_end_identical_and_each_step_counts_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(HERE / "_lightning_ddp.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 3
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name
    report = json.loads((tmp_path / "veil" / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 3
    three_steps = [SelfComposed(dpsgd_event(16 / 64, report["noise_multiplier"]), 3)]
    assert report["epsilon_spent"] == pytest.approx(epsilon_of(three_steps, 1e-3), rel=1e-6)
    registry = open_registry()
    try:
        status = registry.status(dataset_identity(dataset_id="ddp-toy"), per_run=True)
    finally:
        registry.close()
    assert len(status.runs) == 1  # rank 0 alone charged the run
    assert status.spent_epsilon == pytest.approx(report["epsilon_spent"], rel=1e-3)
