"""The number of trials ``veil tune`` runs follows the law it is charged for (issue 23, planted bug:
the Poisson law sampled from k = 1 instead of 0).

The bound of :mod:`veil.accounting.tuning` holds only if K is drawn from the stated law; a sampler
that never draws K = 0, or shifts K by one, runs a procedure the accounting does not describe. The
references are scipy's distributions, independent of veil's ``pmf``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import veil.accounting.tuning as tuning
from veil.accounting.tuning import TrialCount

DRAWS = 4000
P_MIN = 1e-6
"""Each χ² test fails a correct sampler with probability 1e-6 (8 cases: < 1e-5 in all); the draws are
seeded, so a given run is deterministic."""

# Every law the CLI offers (--trials-law, --trials-shape, --trials-mean), K = 0 included (Poisson).
CASES = [
    ("poisson", 1.0, 1.0),  # the smallest mean the CLI offers (below 1 it is refused): P(K = 0) = 1/e
    ("poisson", 1.0, 3.0),
    ("negative_binomial", 0.0, 3.0),
    ("negative_binomial", 0.5, 3.0),
    ("negative_binomial", 1.0, 2.0),
    ("negative_binomial", 2.0, 5.0),
    ("negative_binomial", 0.5, 1.0),
]


def _reference(count: TrialCount, k: np.ndarray) -> np.ndarray:
    """P[K = k] from scipy: Poisson, or the negative binomial truncated at K ≥ 1 (η = 0: logarithmic)."""
    if count.law == "poisson":
        return np.asarray(stats.poisson(count.mean).pmf(k))
    g = count.gamma
    if g == 1.0:
        return (k == 1).astype(float)
    if count.shape == 0:
        return np.asarray(stats.logser(1 - g).pmf(k))
    nb = stats.nbinom(count.shape, g)
    return np.where(k >= 1, nb.pmf(k) / (1 - nb.pmf(0)), 0.0)


def _seeded(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Seed the sampler's uniforms, and stop a sampler whose cumulative sum never reaches its uniform
    (mass missing from the law it walks: it would search up to k = 10⁷ per draw)."""
    rng = np.random.default_rng(seed)
    draw = lambda bits: int(rng.integers(0, 2**bits, dtype=np.uint64))  # noqa: E731
    monkeypatch.setattr(tuning.secrets, "randbits", draw)
    pmf = TrialCount.pmf

    def bounded(self: TrialCount, k: int) -> float:
        assert k <= 10_000, "the sampler walked past K = 10000: its cumulative law never reached the uniform"
        return pmf(self, k)

    monkeypatch.setattr(TrialCount, "pmf", bounded)


@pytest.mark.parametrize(("law", "shape", "mean"), CASES)
def test_sampled_trial_counts_follow_the_stated_law(
    law: str, shape: float, mean: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = TrialCount(mean, law, shape)  # type: ignore[arg-type]
    _seeded(monkeypatch, 20261201)
    draws = np.array([count.sample() for _ in range(DRAWS)])
    top = int(draws.max()) + 2000
    k = np.arange(top + 1)
    ref = _reference(count, k)
    assert ref.sum() == pytest.approx(1.0, abs=1e-6)
    assert float((k * ref).sum()) == pytest.approx(mean, rel=1e-6)
    if law == "poisson":  # K = 0 is a possible outcome, with its own probability
        assert (draws == 0).any()
    else:
        assert draws.min() >= 1
    observed = np.bincount(draws, minlength=top + 1)
    expected = ref * DRAWS
    # Bins with expected count ≥ 5 each, the rest (both tails) merged with their neighbour.
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_o or acc_e:
        if not bins_e:
            bins_o, bins_e = [acc_o], [acc_e]
        else:
            bins_o[-1] += acc_o
            bins_e[-1] += acc_e
    if len(bins_e) == 1:  # a point mass (mean 1): every draw must be that value
        assert observed[1] == DRAWS
        return
    chi2 = sum((o - e) ** 2 / e for o, e in zip(bins_o, bins_e, strict=True))
    p = stats.chi2(len(bins_e) - 1).sf(chi2)
    assert p > P_MIN, f"{law} η={shape} mean={mean}: χ² = {chi2:.1f}, p = {p:.2e}"


def test_tune_end_to_end_with_the_real_trial_count(tmp_path: Path) -> None:
    """No mock of ``TrialCount.sample``: the run draws K itself (Poisson, mean 1: K = 0 with
    probability 1/e), runs exactly K trials, and releases a model only if it ran one."""
    from veil.cli.main import main

    out = tmp_path / "run"
    code = main(["tune", "--dataset", "breast-cancer", "--epsilon", "3", "--out", str(out), "--json",
                 "--trials-law", "poisson", "--trials-mean", "1", "--epochs", "1", "--batch-size", "128",
                 "--model", "logreg", "--lr", "1.0", "--max-grad-norm", "1", "--preset-share", "0",
                 "--no-compare-preset"])  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    k = report["non_private"]["trials_run"]
    assert k == len(report["non_private"]["trials"]) == len(list((out / "trials").glob("*")))
    assert (out / "model.pt").exists() == (k > 0) and (report["chosen"] is None) == (k == 0)
    assert report["budget_split"]["event"]["law"] == "poisson"
    assert report["budget_split"]["event"]["mean"] == pytest.approx(1.0)
    assert math.isfinite(report["epsilon"]) and report["epsilon"] <= 3.0 + 1e-9
