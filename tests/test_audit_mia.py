"""Membership-inference attacks: ROC numbers against brute force, LiRA against its formula, and the
loss attack on an overfit non-private model trained by veil's pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from veil.audit.mia import (
    lira_scores,
    logit_confidence,
    loss_attack,
    per_example_loss,
    roc_result,
    run_lira,
    shadow_membership,
)
from veil.audit.run import AuditSettings, audit
from veil.errors import InvalidParameterError
from veil.mechanisms.rng import SeededSource


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    # Tiny models: intra-op threads only add synchronisation cost on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _brute_force(pos: np.ndarray, neg: np.ndarray, max_fpr: float) -> tuple[float, float]:
    """AUC by counting pairs (ties count ½) and the best TPR over thresholds with FPR ≤ max_fpr."""
    pairs = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    best = 0.0
    for t in np.concatenate([pos, neg, [np.inf]]):
        fpr = np.mean(neg >= t)
        if fpr <= max_fpr:
            best = max(best, float(np.mean(pos >= t)))
    return pairs / (len(pos) * len(neg)), best


def test_roc_numbers_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    pos = np.round(rng.normal(0.7, 1, 120), 1)  # rounding makes ties
    neg = np.round(rng.normal(0.0, 1, 150), 1)
    r = roc_result(pos, neg, "test")
    auc, tpr1 = _brute_force(pos, neg, 0.01)
    _, tpr01 = _brute_force(pos, neg, 0.001)
    assert r.auc == pytest.approx(auc, abs=1e-12)
    assert r.tpr_at_1pct_fpr == pytest.approx(tpr1)
    assert r.tpr_at_0_1pct_fpr == pytest.approx(tpr01)
    d = r.to_dict()
    assert set(d) >= {"auc", "tpr_at_0.1pct_fpr", "tpr_at_1pct_fpr", "members", "nonmembers"}
    with pytest.raises(InvalidParameterError):
        roc_result([], neg, "test")


def test_loss_and_logit_confidence_formulas() -> None:
    logits = np.array([[2.0, 0.5, -1.0], [0.0, 0.0, 0.0], [-3.0, 4.0, 1.0]])
    y = np.array([0, 2, 1])
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    py = p[np.arange(3), y]
    np.testing.assert_allclose(per_example_loss(logits, y), -np.log(py), rtol=1e-12)
    np.testing.assert_allclose(logit_confidence(logits, y), np.log(py) - np.log1p(-py), rtol=1e-12)
    big = np.array([[80.0, 0.0]])  # p_y = 1 in float64: the stable form stays finite
    assert logit_confidence(big, np.array([0]))[0] == pytest.approx(80.0)


def test_shadow_membership_is_balanced() -> None:
    inside = shadow_membership(500, 6, SeededSource(0))
    assert inside.shape == (6, 500) and (inside.sum(axis=0) == 3).all()
    assert 200 < inside[0].sum() < 300  # each shadow sees about half the pool
    with pytest.raises(InvalidParameterError, match="shadow"):
        shadow_membership(10, 1, SeededSource(0))


def test_lira_scores_follow_the_likelihood_ratio() -> None:
    rng = np.random.default_rng(1)
    n, k = 400, 16
    mu = rng.normal(0, 2, n)  # per-example difficulty
    inside = shadow_membership(n, k, SeededSource(2))
    phi = mu[None, :] + 1.5 * inside + rng.standard_normal((k, n))
    member = rng.random(n) < 0.5
    target = mu + 1.5 * member + rng.standard_normal(n)
    online = lira_scores(target, phi, inside, variant="online", fixed_variance=False)
    # One example by hand: Gaussian log-density ratio with per-example means and stds.
    i = 7
    a, b = phi[inside[:, i], i], phi[~inside[:, i], i]

    def logpdf(t: float, m: float, s: float) -> float:
        return -0.5 * ((t - m) / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi)

    want = logpdf(target[i], a.mean(), a.std(ddof=1)) - logpdf(target[i], b.mean(), b.std(ddof=1))
    assert online[i] == pytest.approx(want, rel=1e-9)
    offline = lira_scores(target, phi, inside, variant="offline")
    loss_only = target  # the uncalibrated statistic, what a loss attack sees
    auc_online = roc_result(online[member], online[~member], "lira").auc
    auc_offline = roc_result(offline[member], offline[~member], "lira").auc
    auc_plain = roc_result(loss_only[member], loss_only[~member], "loss").auc
    assert auc_online > auc_plain + 0.1 and auc_offline > auc_plain + 0.1  # calibration helps


def test_run_lira_with_a_trainer() -> None:
    # The orchestration: shadows trained on their halves, scored, evaluated on the target.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((120, 5)).astype(np.float32)
    y = (rng.random(120) < 0.5).astype(np.int64)
    member = np.arange(120) < 60

    def fit(idx: np.ndarray, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 2))
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        xi, yi = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        for _ in range(150):
            opt.zero_grad()
            nn.functional.cross_entropy(m(xi), yi).backward()
            opt.step()
        return m

    target = fit(np.flatnonzero(member), 99)
    r = run_lira(target, (x, y), member, fit, shadows=4, rng=SeededSource(0))
    assert r.variant == "offline" and r.shadow_models == 4
    assert r.auc > 0.7  # random labels are memorised: membership is plain to see
    assert loss_attack(target, (x[member], y[member]), (x[~member], y[~member])).auc > 0.7


def test_loss_attack_on_an_overfit_non_private_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # veil's own pipeline, σ = 0 and a clip norm that never binds: an MLP on 150 noisy examples
    # memorises them; the loss attack then separates members from held-out examples.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 10)).astype(np.float32)
    y = (x[:, 0] + 1.5 * rng.standard_normal(300) > 0).astype(np.int64)
    np.savez(tmp_path / "noisy.npz", x=x, y=y)
    config = {
        "dataset": f"npz:{tmp_path / 'noisy.npz'}",
        "classes": ["0", "1"],
        "model": "mlp",
        "epochs": 100,
        "batch_size": 30,
        "lr": 0.5,
        "max_grad_norm": 100.0,
        "test_fraction": 0.5,
        "feature_bounds": [[-5.0, 5.0]],
        "delta": 1e-4,
    }
    report = audit(config, AuditSettings(attack="loss", non_private=True), write=False)
    assert report.mia is not None and report.mia["attack"] == "loss"
    assert report.mia["auc"] > 0.65
    assert report.epsilon_lower_bound is None and report.verdict == "not_audited"
