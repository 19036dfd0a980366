"""`veil budget show`: each run's ε stated at its own δ, short run ids, readable at 80 columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from dp_accounting.pld import privacy_loss_distribution as dpa_pld

from veil.accounting.events import Gaussian, PoissonSampled, SelfComposed
from veil.cli.main import main
from veil.registry.store import BudgetRegistry

RUNS = (  # run id, job, (q, σ, steps), the run's own δ, finished
    ("0f3c9a7be21d4c0a9d8e7f6a5b4c3d2e", "train", (0.02, 1.1, 400), 1e-5, True),
    ("7a61d0c2f9e84b1c8d2e3f4a5b6c7d8e", "federated", (0.05, 1.5, 200), 1e-6, True),
    ("c4b8e2a1d7f6490e8a7b6c5d4e3f2a1b", "synth", (0.01, 2.0, 100), 1e-7, False),
)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "team.db"
    with BudgetRegistry(path) as registry:
        registry.set_budget("census", 20.0, 1e-4)
        for run_id, job, (q, s, n), delta, finished in RUNS:
            events = [SelfComposed(PoissonSampled(q, Gaussian(s)), n)]
            registry.reserve("census", events, run_id, job=job, delta=delta)
            if finished:
                registry.commit(run_id, events)
    return path


def _reference(q: float, sigma: float, steps: int, delta: float) -> float:
    pld = dpa_pld.from_gaussian_mechanism(sigma, sampling_prob=q).self_compose(steps)
    return float(pld.get_epsilon_for_delta(delta))


def test_each_run_is_stated_at_its_own_delta(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    assert main(["budget", "show", "--db", str(db), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["datasets"][0]
    assert status["delta"] == pytest.approx(1e-4)  # the dataset's total is stated at the budget's δ
    for run, (_, _, (q, s, n), delta, _) in zip(status["runs"], RUNS, strict=True):
        assert run["epsilon_delta"] == pytest.approx(delta) == pytest.approx(run["delta"])
        # The pair (ε, δ) is the run's own guarantee: dp-accounting's ε at the run's δ, not at 1e-4.
        assert run["epsilon"] == pytest.approx(_reference(q, s, n, delta), rel=0.02)
        assert run["epsilon"] > _reference(q, s, n, 1e-4) * 1.02


def test_table_fits_80_columns_with_short_ids(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Path
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["budget", "show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    for run_id, job, _, delta, finished in RUNS:
        row = [line for line in lines if run_id[:8] in line]
        assert len(row) == 1, out  # one line per run: the id is not folded over several lines
        assert run_id not in out  # short ids in the table (--json has the whole id)
        assert job in row[0] and f"{delta:.0e}" in row[0]
        assert ("reserved*" in row[0]) is (not finished)
    assert "* reserved" in out
