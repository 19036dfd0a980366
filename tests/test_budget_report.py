"""``veil budget report``: each run's ε at its own δ, the spend over time, the JSON and the page.

Two runs of a Gaussian mechanism on one dataset, recorded straight in a registry (no training): each
run's own ε is checked against the analytic Gaussian mechanism's (ε, δ) curve (Balle & Wang 2018)
at that run's own δ, an independent closed form; the last point of the spend over time is the
dataset's composed spend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from veil.accounting.events import Gaussian
from veil.cli.main import main
from veil.registry.store import BudgetRegistry

pytest.importorskip("sqlalchemy")


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """ε of the Gaussian mechanism (sensitivity 1, std σ) at δ, by bisection on the exact curve
    δ(ε) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ)."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def delta_of(eps: float) -> float:
        return phi(0.5 / sigma - eps * sigma) - math.exp(eps) * phi(-0.5 / sigma - eps * sigma)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    db = tmp_path / "budget.db"
    with BudgetRegistry(db) as reg:
        reg.set_budget("clinic-2026", 6.0, 1e-5)
        for run_id, sigma, delta in (("a" * 32, 2.0, 1e-5), ("b" * 32, 3.0, 1e-7)):
            reg.reserve("clinic-2026", [Gaussian(sigma)], run_id, job="synth", delta=delta)
            reg.commit(run_id, [Gaussian(sigma)])
            reg.note_run(run_id, "ana", None)
    return db


def test_each_run_is_stated_at_its_own_delta_and_the_spend_over_time_ends_at_the_total(
    registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["budget", "report", "--db", str(registry), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "budget.json").read_text())
    assert printed == saved
    (d,) = saved["datasets"]
    assert d["dataset_id"] == "clinic-2026" and d["budget_epsilon"] == 6.0 and d["budget_delta"] == 1e-5
    for run, sigma, delta in zip(d["runs"], (2.0, 3.0), (1e-5, 1e-7), strict=True):
        assert run["delta"] == delta and run["user"] == "ana" and run["job"] == "synth"
        assert run["epsilon"] == pytest.approx(_gaussian_epsilon(sigma, delta), rel=2e-3)  # own δ
    curve = [p["spent_epsilon"] for p in d["spent_over_time"]]
    assert len(curve) == 2 and curve[0] < curve[1] == pytest.approx(d["spent_epsilon"])
    assert curve[0] == pytest.approx(_gaussian_epsilon(2.0, 1e-5), rel=2e-3)  # first run at the budget's δ
    assert d["left_epsilon"] == pytest.approx(6.0 - d["spent_epsilon"])
    page = (out / "index.html").read_text()
    assert "clinic-2026" in page and "ana" in page and "data:image/png;base64," in page


def test_one_dataset_only_and_an_empty_registry(registry: Path, tmp_path: Path) -> None:
    with BudgetRegistry(registry) as reg:
        reg.set_budget("name:other", 1.0, 1e-6)  # what --dataset-id other names
    out = tmp_path / "one"
    assert main(["budget", "report", "--db", str(registry), "--dataset-id", "other", "--out", str(out)]) == 0
    (d,) = json.loads((out / "budget.json").read_text())["datasets"]
    assert d["dataset_id"] == "name:other" and d["runs"] == [] and d["spent_over_time"] == []
    empty = tmp_path / "empty"
    assert main(["budget", "report", "--db", str(tmp_path / "new.db"), "--out", str(empty)]) == 0
    assert json.loads((empty / "budget.json").read_text())["datasets"] == []
    assert "No dataset is recorded" in (empty / "index.html").read_text()


def test_no_end_time_on_the_page(registry: Path, tmp_path: Path) -> None:
    """A run's end with its start gives its duration, a function of the private data: the page (and
    budget.json) put each run at its admission time only."""
    import sqlite3

    db = sqlite3.connect(registry)
    db.execute("UPDATE veil_budget_runs SET finished_at = '2031-07-04T12:34:56Z'")
    db.commit()
    created = [row[0] for row in db.execute("SELECT created_at FROM veil_budget_runs ORDER BY rowid")]
    db.close()
    out = tmp_path / "report"
    assert main(["budget", "report", "--db", str(registry), "--out", str(out)]) == 0
    for name in ("budget.json", "index.html"):
        assert "2031" not in (out / name).read_text()
    (d,) = json.loads((out / "budget.json").read_text())["datasets"]
    assert [p["at"] for p in d["spent_over_time"]] == created
