"""The non-private baseline trains to convergence on its own validation split, or says it was capped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from veil.config import make_config


def _table(path: Path) -> Path:
    """A linear rule over 20 features of very different scales: one DP epoch is far from converged."""
    g = np.random.default_rng(0)
    n, d = 3000, 20
    scales = np.linspace(0.2, 5, d)
    x = g.normal(0, 1, (n, d)) * scales
    y = (x @ (g.normal(0, 1, d) / scales) + 0.3 * g.normal(0, 1, n) > 0).astype(int)
    lines = [",".join(f"f{i}" for i in range(d)) + ",y"]
    lines += [",".join(f"{v:.4f}" for v in x[i]) + f",{'ny'[y[i]]}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _plan(tmp_path: Path):
    from veil.training.prepare import prepare_run

    cfg = {"dataset": f"csv:{_table(tmp_path / 't.csv')}", "target": "y", "classes": ["n", "y"]}
    return prepare_run(
        make_config({**cfg, "epochs": 1, "epsilon": 1.0, "model": "logreg"}), None, check=False
    )


def test_a_linear_baseline_reaches_what_a_converged_solver_reaches(tmp_path: Path) -> None:
    """Independent reference: scikit-learn's L-BFGS logistic regression (almost unregularised) on the
    same model inputs and split. The old baseline (the DP run's one epoch of Adam) stopped at 0.767."""
    import torch
    from sklearn.linear_model import LogisticRegression

    from veil.pipeline.baseline import train_baseline
    from veil.pipeline.loop import trainable_view
    from veil.pipeline.model import build_net

    plan = _plan(tmp_path)
    result = train_baseline(plan, "cpu")
    assert result.stopped.startswith("converged"), result.stopped
    view, x_train, x_test = trainable_view(plan, build_net(plan.cfg, plan.data, plan.cfg.seed), "cpu")
    with torch.no_grad():  # the model's own fixed input transform, then the linear layer sklearn fits
        features = [view.model.preprocess(torch.from_numpy(x)).numpy() for x in (x_train, x_test)]
    reference = LogisticRegression(C=1e4, max_iter=10_000).fit(features[0], plan.data.y_train)
    assert result.test_accuracy >= reference.score(features[1], plan.data.y_test) - 0.01


def test_a_capped_baseline_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import veil.pipeline.baseline as baseline
    from veil.cli.main import main

    monkeypatch.setattr(baseline, "MIN_STEPS", 0)  # the cap is then one step per planned DP step
    monkeypatch.setattr(baseline, "STEPS_PER_DP_STEP", 1)
    monkeypatch.setattr(baseline, "LBFGS_ITERATIONS", 1)
    data = _table(tmp_path / "t.csv")
    args = ["train", "--dataset", f"csv:{data}", "--target", "y", "--classes", "n,y", "--epochs", "1",
            "--batch-size", "2000", "--model", "logreg", "--epsilon", "1"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["non_private"]["baseline_stopped"].startswith(f"capped at {report['steps']} steps")
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "(capped: may understate the cost of privacy)" in capsys.readouterr().out
