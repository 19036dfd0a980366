"""Shared test setup: runs record their spend in a test registry, never in the user's own.

Every test gets its own privacy-budget registry (a SQLite file in its tmp folder), so a budget one test
sets cannot refuse another test's run. Module- and session-scoped fixtures run before any function-scoped
fixture, so a session-wide registry covers the runs they make.

Under pytest-xdist (``make test`` runs ``-n 2``) each worker gets an equal share of the cores for torch's
threads, and so do the processes a test starts (``OMP_NUM_THREADS``), so the workers do not
oversubscribe the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(share)


LONGEST_FILES = (
    "test_readme.py",
    "test_federated_interrupt.py",
    "test_federated_flower.py",
    "test_crash_safety.py",
    "test_distributed_train.py",
)
"""The suite's longest files (each a few minutes on 2 cores): handed to the xdist workers first, so that
no worker is left running one of them alone at the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT") is None:
        return

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: every other file keeps its order


@pytest.fixture(autouse=True, scope="session")
def _session_budget_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setenv("VEIL_BUDGET_DB", str(tmp_path_factory.mktemp("registry") / "veil-budget.db"))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _own_budget_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "veil-budget.db"))


@pytest.fixture(scope="session")
def job_runs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``job_runs(job)``: one small run of ``job`` through the CLI under umask 022, made once per session
    (``tests/_job_runs.py``), with a registry of its own: ``(run folder, report.json)``."""
    from _job_runs import run_job
    from veil.accounting.tuning import TrialCount

    done: dict[str, tuple[Path, dict]] = {}

    def get(job: str) -> tuple[Path, dict]:
        if job not in done:
            patch = pytest.MonkeyPatch()
            folder = tmp_path_factory.mktemp(job)
            patch.setenv("VEIL_BUDGET_DB", str(folder / "registry" / "budget.db"))  # created by this run
            patch.setattr(TrialCount, "sample", lambda self: 1)  # tune: one trial, the stated law accounted
            try:
                done[job] = run_job(job, folder)
            finally:
                patch.undo()
        return done[job]

    return get
