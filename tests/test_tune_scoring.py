"""``veil tune`` without a held-out part (the default): each trial trains on every row of the training
split and its noisy score counts the correct predictions on those same rows (issue 29).

The accounting is checked against an independent reference: dp-accounting's RDP accountant over the
procedure written out from closed forms (q = B / N with N the rows of the training split loaded
apart, ⌈N / B⌉ steps per epoch, the score a Gaussian of sensitivity 1 and the given std), not from the
event the job built."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import RdpAccountant

from veil.accounting.ledger import Ledger
from veil.cli.main import main
from veil.tune.budget import ORDERS


def _rdp_epsilon(curve: np.ndarray, delta: float) -> float:
    """RDP → (ε, δ) (Canonne, Kamath & Steinke 2020, Prop. 12) over the orders of the curve."""
    a = np.asarray(ORDERS)
    return float(np.min(curve + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)))


def test_scoring_on_the_training_rows_is_charged_as_one_procedure_on_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.accounting.tuning import TrialCount
    from veil.data.builtin import load_builtin

    monkeypatch.setattr(TrialCount, "sample", lambda self: 1)  # one trial, for speed; the law is charged
    out, batch, epochs, std, mean = tmp_path / "tune", 128, 2, 10.0, 2.0
    code = main(["tune", "--dataset", "breast-cancer", "--epsilon", "3", "--out", str(out),
                 "--db", str(tmp_path / "budget.db"), "--validation-fraction", "0",
                 "--trials-mean", str(mean), "--score-noise", str(std), "--epochs", str(epochs),
                 "--batch-size", str(batch), "--model", "logreg", "--lr", "1.0", "--max-grad-norm", "1",
                 "--preset-share", "0", "--no-compare-preset"])  # fmt: skip
    assert code == 0
    r = json.loads((out / "report.json").read_text())
    n = load_builtin("breast-cancer", test_fraction=0.2, seed=0).n_train  # loaded apart from the job
    assert r["n_records"] == n and r["validation_fraction"] == 0 and "no hold-out" in r["score_rows"]
    assert r["non_private"]["n_train"] == n and r["non_private"]["n_validation"] == 0
    ledger = Ledger.open(out / "trials" / "1" / "ledger.jsonl")
    (score,) = [rec for rec in ledger.records if rec["kind"] == "score"]
    assert score["n_validation"] == n  # every training row scored
    (shape,) = r["budget_split"]["shapes"]
    sigma = shape["noise_multiplier"]
    steps = epochs * math.ceil(n / batch)
    # breast-cancer has no declared bounds: its DP centring (not this path) is the trial's first event.
    pre = next(e for e in r["budget_split"]["event"]["event"]["events"] if e["type"] == "gaussian")
    trial = dpe.ComposedDpEvent(
        [
            dpe.GaussianDpEvent(pre["noise_multiplier"]),
            dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(batch / n, dpe.GaussianDpEvent(sigma)), steps),
            dpe.GaussianDpEvent(std),  # a count of sensitivity 1 with noise std `std`
        ]
    )
    acc = RdpAccountant(orders=list(ORDERS))
    acc.compose(dpe.RepeatAndSelectDpEvent(trial, mean, 0.5))  # the CLI's default shape η = 0.5
    reference = _rdp_epsilon(np.asarray(acc._rdp), r["delta"])
    # The secure lattice's correction makes veil's own events a hair more conservative.
    assert r["epsilon"] == pytest.approx(reference, rel=2e-3)
    assert r["epsilon"] >= reference * (1 - 1e-9) and r["epsilon"] <= 3.0


def test_a_held_out_share_releases_public_sizes_and_a_score_over_a_public_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--validation-fraction F`` the exact sizes of the two parts are private (a record's side
    is a keyed hash with a public key: the exact count says which side the one differing record fell
    on; review revD F6): the release holds N, F and F·N only, and the noisy accuracy is the noisy count
    over F·N, a public number, never over the exact count."""
    from veil.accounting.tuning import TrialCount
    from veil.data.builtin import load_builtin

    monkeypatch.setattr(TrialCount, "sample", lambda self: 1)
    out, fraction = tmp_path / "tune", 0.3
    code = main(["tune", "--dataset", "breast-cancer", "--epsilon", "3", "--out", str(out),
                 "--validation-fraction", str(fraction), "--trials-mean", "2", "--score-noise", "10",
                 "--epochs", "1", "--batch-size", "128", "--model", "logreg", "--lr", "1.0",
                 "--max-grad-norm", "1", "--preset-share", "0", "--no-compare-preset"])  # fmt: skip
    assert code == 0
    r = json.loads((out / "report.json").read_text())
    n = load_builtin("breast-cancer", test_fraction=0.2, seed=0).n_train
    assert r["n_records"] == n and r["validation_fraction"] == fraction
    assert r["score_over"] == pytest.approx(fraction * n)
    exact = r["non_private"]["n_validation"]
    assert 0 < exact < n and r["non_private"]["n_train"] == n - exact
    released = json.loads((out / "release" / "report.json").read_text())
    for key in ("n_train", "n_validation"):
        assert key not in released and key not in released["tune"]
    ledger = Ledger.open(out / "trials" / "1" / "ledger.jsonl")
    (score,) = [rec for rec in ledger.records if rec["kind"] == "score"]
    assert score["n_validation"] == exact  # the exact count stays in the internal ledger
    noisy = r["chosen"]["noisy_validation_accuracy"]
    assert noisy == pytest.approx(score["noisy_correct"] / (fraction * n), rel=1e-12)
    assert noisy != pytest.approx(score["noisy_correct"] / exact, rel=1e-12)  # F·N is not an integer
