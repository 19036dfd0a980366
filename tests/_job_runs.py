"""One small run of each job through the CLI, shared by the report-schema and run-folder tests.

Each run is made with the umask at 022 (the usual default), so a test can check that what a job
writes outside ``release/`` is owner-only whatever the umask.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from test_registry_jobs import SYNTH_SCHEMA  # one schema text for the small job tables
from veil.cli.main import main


def _synth_table(n: int) -> str:
    rng = np.random.default_rng(0)
    rows = ["age,city,label"]
    for _ in range(n):
        age = float(rng.uniform(20, 80))
        rows.append(f"{age:.1f},{'abc'[int(rng.integers(0, 3))]},{'yes' if age > 50 else 'no'}")
    return "\n".join(rows) + "\n"


def argv_for(job: str, out: Path, folder: Path) -> list[str]:
    """A small, fast command line for ``job`` writing to ``out`` (inputs written into ``folder``)."""
    if job == "train":
        return ["train", "--dataset", "digits", "--model", "logreg", "--epochs", "1", "--epsilon", "3",
                "--out", str(out)]  # fmt: skip
    if job == "tune":
        return ["tune", "--dataset", "digits", "--epsilon", "3", "--trials-mean", "1", "--epochs", "1",
                "--batch-size", "256", "--model", "logreg", "--lr", "1.0", "--max-grad-norm", "1",
                "--out", str(out)]  # fmt: skip
    if job == "pate":
        return ["pate", "--dataset", "digits", "--teachers", "10", "--sigma", "2", "--epsilon", "10",
                "--queries", "20", "--no-semi-supervised", "--out", str(out)]  # fmt: skip
    if job == "synth":
        (folder / "schema.toml").write_text(SYNTH_SCHEMA)
        (folder / "data.csv").write_text(_synth_table(400))
        return ["synth", "--dataset", f"csv:{folder / 'data.csv'}", "--schema", str(folder / "schema.toml"),
                "--epsilon", "2", "--delta", "1e-6", "--rows", "100", "--out", str(out),
                "--iterations", "50", "--bins", "4"]  # fmt: skip
    if job == "federated":
        return ["federated", "--dataset", "digits", "--model", "logreg", "--clients", "3", "--rounds", "1",
                "--epsilon", "8", "--delta", "1e-3", "--out", str(out)]  # fmt: skip
    if job == "audit":
        return ["audit", "--dataset", "digits", "--noise-multiplier", "0", "--epochs", "1",
                "--canaries", "20", "--attack", "loss", "--out", str(out)]  # fmt: skip
    raise ValueError(job)


def run_job(job: str, folder: Path) -> tuple[Path, dict[str, Any]]:
    """Run ``job`` into ``folder/run`` under umask 022; its folder and ``report.json``."""
    out = folder / "run"
    before = os.umask(0o022)
    try:
        code = main(argv_for(job, out, folder))
    finally:
        os.umask(before)
    assert code == 0, job
    return out, json.loads((out / "report.json").read_text())


def keys_outside(report: Any, section: str = "non_private", path: str = "") -> Iterator[str]:
    """Every key path of ``report`` outside its ``section`` (dotted)."""
    if isinstance(report, dict):
        for key, value in report.items():
            if not path and key == section:
                continue
            here = f"{path}.{key}" if path else str(key)
            yield here
            yield from keys_outside(value, section, here)
    elif isinstance(report, list):
        for item in report:
            yield from keys_outside(item, section, path)
