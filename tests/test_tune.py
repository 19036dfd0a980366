"""veil tune end to end (a tiny space), its report and its accounting; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from veil.accounting.ledger import Ledger
from veil.accounting.rdp import rdp_to_epsilon
from veil.accounting.tuning import TrialCount, tuning_rdp
from veil.cli.main import main
from veil.tune.budget import ORDERS
from veil.tune.space import SearchSpace

TINY = [
    "--epochs",
    "1",
    "--batch-size",
    "256",
    "--model",
    "logreg",
    "--lr",
    "1.0,2.0",
    "--max-grad-norm",
    "1",
]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tune") / "run"
    mp = pytest.MonkeyPatch()
    # K fixed at 2 for a fast test; the accounting below is of the stated law (mean 1.5), as in a real run.
    mp.setattr(TrialCount, "sample", lambda self: 2)
    try:
        code = main(
            [
                "tune",
                "--dataset",
                "digits",
                "--epsilon",
                "3",
                "--out",
                str(out),
                "--json",
                "--trials-mean",
                "1.5",
                *TINY,
            ]
        )
    finally:
        mp.undo()
    assert code == 0
    return out, json.loads((out / "report.json").read_text())


def test_report_has_the_total_and_the_chosen_model(tuned: tuple[Path, dict]) -> None:
    out, r = tuned
    assert r["non_private"]["trials_run"] == 2 and len(r["non_private"]["trials"]) == 2
    assert 0.0 <= r["non_private"]["test_accuracy"] <= 1.0
    assert r["epsilon"] <= 3.0 and r["guarantee"]["epsilon"] == r["epsilon"]
    assert "trials" not in r and "test_accuracy" not in r  # K and test accuracy: only in non_private
    chosen = r["chosen"]
    best = max(r["non_private"]["trials"], key=lambda t: t["noisy_score"])
    assert chosen["noisy_validation_accuracy"] == best["noisy_score"]
    assert (out / "model.pt").is_file() and (out / "report.html").is_file()
    page = (out / "report.html").read_text()
    assert "Non-private diagnostics" in page and "How the budget was split" in page
    assert all(c["passed"] for c in r["checks"])


def test_total_spend_is_reported_never_the_best_trial(tuned: tuple[Path, dict]) -> None:
    """The report's ε is the random-stopping bound recomputed from a trial's ledger, above any one trial."""
    out, r = tuned
    law = r["budget_split"]["trial_count"]
    count = TrialCount(law["mean"], law["law"], law["shape"])
    own = []
    for t in r["non_private"]["trials"]:
        ledger = Ledger.open(out / "trials" / str(t["trial"]) / "ledger.jsonl")
        assert any(rec.get("label") == "validation_score" for rec in ledger.records)
        from veil.accounting.tuning import trial_rdp

        curve = trial_rdp(ledger.events(), ORDERS)
        own.append(rdp_to_epsilon(ORDERS, curve, r["delta"]))
        # One shape in this space: the planned trial curve is this trial's curve.
        total = rdp_to_epsilon(ORDERS, tuning_rdp(ORDERS, curve, count), r["delta"])
        assert r["epsilon"] == pytest.approx(total, rel=1e-9)
    assert r["epsilon"] > max(own) + 0.1


def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "none"
    code = main(["tune", "--epsilon", "0.05", "--out", str(out), *TINY])
    assert code == 2 and not out.exists()
    assert "validation scores" in capsys.readouterr().err
    assert main(["tune", "--lr", "fast", "--out", str(out)]) == 2 and not out.exists()


def test_space_draws_from_the_lists() -> None:
    space = SearchSpace(
        lr=(0.1, 0.2), epochs=(1,), batch_size=(64, 128), max_grad_norm=(1.0,), model=("logreg",)
    )
    draws = [space.draw() for _ in range(200)]
    assert {d.lr for d in draws} == {0.1, 0.2} and {d.batch_size for d in draws} == {64, 128}
    assert space.budget_shapes == [(1, 64), (1, 128)]
    assert np.all([d.epochs == 1 for d in draws])
