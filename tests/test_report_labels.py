"""Issue 23, item 9: a figure computed without noise sits in ``non_private`` (or is labelled so).

PATE's teacher sizes, the public/private duplicate count and the private row count; tune's trial
count K (releasing it voids the tuning bound) and test accuracy; the ledger's plain dataset SHA-256
and the checkpoints' test history: each is either inside ``non_private`` or labelled non-private in
``files`` and on the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import markupsafe
import pytest

from _job_runs import keys_outside


@pytest.fixture
def pate_run(job_runs: Any) -> tuple[Path, dict[str, Any]]:
    return job_runs("pate")  # type: ignore[no-any-return]


@pytest.fixture
def tune_run(job_runs: Any) -> tuple[Path, dict[str, Any]]:
    return job_runs("tune")  # type: ignore[no-any-return]


@pytest.fixture
def train_run(job_runs: Any) -> tuple[Path, dict[str, Any]]:
    return job_runs("train")  # type: ignore[no-any-return]


def _leaf_names(report: dict[str, Any]) -> set[str]:
    return {path.rsplit(".", 1)[-1] for path in keys_outside(report)}


def test_pate_unnoised_counts_are_only_in_non_private(pate_run: tuple[Path, dict[str, Any]]) -> None:
    _, r = pate_run
    outside = _leaf_names(r)
    for name in ("teacher_sizes", "public_private_duplicates", "n_private"):
        assert name not in outside, name
    flat = set(keys_outside(r["non_private"], section=""))
    assert {"teacher_sizes", "public_private_duplicates", "n_private"} <= {p.rsplit(".", 1)[-1] for p in flat}


def test_tune_trial_count_and_test_accuracy_are_only_in_non_private(
    tune_run: tuple[Path, dict[str, Any]],
) -> None:
    _, r = tune_run
    assert "trials" not in r and "test_accuracy" not in r  # K at the top level voids the tuning bound
    assert "trials" not in _leaf_names(r) and "test_accuracy" not in _leaf_names(r)
    assert r["non_private"]["trials_run"] == 1 and "test_accuracy" in r["non_private"]


def test_train_files_label_the_fingerprint_and_checkpoints_non_private(
    train_run: tuple[Path, dict[str, Any]],
) -> None:
    out, r = train_run
    ledger, checkpoints = r["files"]["ledger.jsonl"], r["files"]["checkpoints"]
    assert "non-private" in ledger and "SHA-256" in ledger  # the plain fingerprint in its header
    assert "non-private" in checkpoints and "test" in checkpoints  # the test history they hold
    page = (out / "report.html").read_text()
    assert str(markupsafe.escape(ledger)) in page and str(markupsafe.escape(checkpoints)) in page
