"""Processes racing for the last of a dataset's budget never overspend, on SQLite and on PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("psycopg")

from _postgres import postgres_server, skip_without_postgres
from veil.accounting.events import Laplace
from veil.registry.compose import spent_epsilon
from veil.registry.store import BudgetRegistry

RACERS = 6
BUDGET_EPSILON, BUDGET_DELTA = 4.5, 1e-6

# Each racer connects, waits for the start file, then asks for one ε = 1 release (pure Laplace).
WORKER = textwrap.dedent(
    """
    import os, sys, time
    from veil.accounting.events import Laplace
    from veil.errors import BudgetExhaustedError
    from veil.registry.store import BudgetRegistry

    url, run_id, go = sys.argv[1:4]
    registry = BudgetRegistry(url)
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        registry.reserve("contested", [Laplace(1.0)], run_id, job="race")
        print("admitted")
    except BudgetExhaustedError:
        print("refused")
    """
)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('registry') / 'budget.db'}"
        return
    skip_without_postgres()  # in CI: a failure
    with postgres_server() as url:
        yield url


def _fits(count: int) -> bool:
    return spent_epsilon([[Laplace(1.0)]] * count, BUDGET_DELTA) <= BUDGET_EPSILON


def test_racing_processes_never_overspend(db_url: str, tmp_path: Path) -> None:
    capacity = max(k for k in range(1, 10) if _fits(k))
    assert 3 <= capacity < 2 + RACERS  # the budget is contested: some racers must lose
    with BudgetRegistry(db_url) as registry:
        registry.set_budget("contested", BUDGET_EPSILON, BUDGET_DELTA)
        registry.reserve("contested", [Laplace(1.0)], "earlier-1")
        registry.reserve("contested", [Laplace(1.0)], "earlier-2")
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, db_url, f"racer-{i}", str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(RACERS)
    ]
    for proc in racers:  # all connected and waiting: they start together
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=60)
    go.touch()
    outcomes = []
    for proc in racers:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outcomes.append(out.strip())
    admitted = outcomes.count("admitted")
    assert admitted + outcomes.count("refused") == RACERS
    assert admitted == capacity - 2  # every slot used, none twice
    with BudgetRegistry(db_url) as registry:
        status = registry.status("contested")
    assert len([r for r in status.runs if r.charged]) == capacity
    assert status.spent_epsilon <= BUDGET_EPSILON
    assert not status.over_budget


def test_round_trip(db_url: str) -> None:
    """Set, reserve, commit, release and show behave the same on both databases."""
    with BudgetRegistry(db_url) as registry:
        registry.set_budget("round-trip", 3.0, 1e-6)
        registry.reserve("round-trip", [Laplace(1.0)], "rt-a", delta=1e-7)
        registry.reserve("round-trip", [Laplace(1.0)], "rt-b")
        registry.commit("rt-a", [Laplace(2.0)])
        status = registry.release("rt-b")
    assert [(r.run_id, r.status) for r in status.runs] == [("rt-a", "committed"), ("rt-b", "released")]
    assert status.spent_epsilon == pytest.approx(0.5, abs=1e-3)
    assert status.remaining_epsilon == pytest.approx(2.5, abs=1e-3)
