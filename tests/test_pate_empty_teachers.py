"""A teacher without data abstains (issue 25): more teachers than examples, or a hash that leaves a
teacher empty, is no longer refused after the private rows are read; the empty teacher's vote
vector is zero, so each query's histogram sums to the teachers with data (at most K).

References are independent of the code under test: vote counts by a naive loop over the teachers,
and the budget registry's record of the run against the released labels' (ε, δ)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from _budget_cli import cli, show
from veil.pate.partition import partition_teachers
from veil.pate.teachers import ABSTAIN, TeacherVotes, mean_accuracy, train_teachers


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def test_more_teachers_than_examples_is_a_partition_with_empty_teachers() -> None:
    x, y = _data(40)
    part = partition_teachers(x, y, 60, seed=0)  # was refused: "only 40 examples"
    assert part.num_teachers == 60 and part.num_units == 40
    assert part.sizes.sum() == 40 and (part.sizes == 0).sum() >= 20
    # Still one teacher per example, by the example's own content: removing one changes one teacher.
    again = partition_teachers(x[1:], y[1:], 60, seed=0)
    assert np.array_equal(again.assignment, part.assignment[1:])


def test_vote_counts_skip_abstaining_teachers() -> None:
    rng = np.random.default_rng(4)
    k, n, c = 9, 30, 4
    public = rng.integers(0, c, size=(k, n))
    public[[2, 7]] = ABSTAIN  # two teachers without data
    votes = TeacherVotes(public=public, test=public[:, :5], sizes=np.ones(k, np.int64), resumed=0)
    hist = votes.histograms(c)
    naive = np.zeros((n, c), dtype=np.int64)
    for t in range(k):
        for q in range(n):
            if public[t, q] != ABSTAIN:
                naive[q, public[t, q]] += 1
    assert np.array_equal(hist, naive)
    assert np.all(hist.sum(axis=1) == k - 2)
    # The teachers' mean accuracy is over the teachers that vote.
    y = rng.integers(0, c, size=5)
    voting = np.delete(public[:, :5], [2, 7], axis=0)
    assert mean_accuracy(public[:, :5], y) == pytest.approx(float(np.mean(voting == y)))


def test_an_empty_partition_trains_no_model_and_abstains() -> None:
    x, y = _data(60, seed=1)
    assignment = np.where(np.arange(60) % 2 == 0, 0, 2)  # teacher 1 holds nothing
    fitted: list[int] = []

    class Majority:
        def __init__(self, index: int) -> None:
            self.index = index

        def fit(self, xs: np.ndarray, ys: np.ndarray) -> None:
            fitted.append(self.index)
            self.label = int(np.bincount(ys).argmax())

        def predict(self, xs: np.ndarray) -> np.ndarray:
            return np.full(len(xs), self.label)

    votes = train_teachers(x, y, assignment, 3, 2, x[:7], x[:3], Majority)
    assert sorted(fitted) == [0, 2]
    assert np.all(votes.public[1] == ABSTAIN) and np.all(votes.test[1] == ABSTAIN)
    assert np.all(votes.public[[0, 2]] >= 0)
    assert np.all(votes.histograms(2).sum(axis=1) == 2)


def test_labelling_takes_histograms_summing_to_at_most_k() -> None:
    from veil.errors import InvalidParameterError
    from veil.pate.aggregators import make_aggregator
    from veil.pate.label_settings import LabelSettings
    from veil.pate.labelling import label_queries
    from veil.pipeline.randomness import private_source
    from veil.pipeline.seeds import Purpose

    agg = make_aggregator("gnmax", 1.0, None, None, 10)
    s = LabelSettings(aggregator=agg, epsilon=20.0, delta=1e-5, max_queries=3, num_teachers=10, num_classes=3)
    hist = np.array([[8, 1, 0], [0, 0, 9], [3, 3, 3]])  # 1, 1 and 1 teachers abstain
    result = label_queries(hist, s, private_source(True, 0, Purpose.PATE_NOISE))
    assert result.queries_asked == 3
    with pytest.raises(InvalidParameterError, match="at most K"):
        label_queries(np.array([[8, 3, 0]]), s, private_source(True, 0, Purpose.PATE_NOISE))


def test_digits_with_250_teachers_runs_and_is_charged_the_released_guarantee(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI run that was refused after reading ("a teacher with no example") now completes; the
    registry holds one pate run at the released labels' (ε, δ), within the target."""
    out = tmp_path / "p"
    code, _, err = cli(capsys, "pate", "--dataset", "digits", "--teachers", "250", "--epsilon", "2",
                       "--teacher-model", "sklearn-logreg", "--student-model", "sklearn-logreg",
                       "--seed", "0", "--out", str(out), "--json")  # fmt: skip
    assert code == 0, err[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["non_private"]["teacher_sizes"]["min"] == 0.0  # seed 0 leaves 2 of 250 teachers empty
    record = show(capsys, "digits")
    assert record["jobs"] == {"pate": 1}
    (run,) = record["runs"]
    g = report["guarantee"]
    assert run["epsilon"] == pytest.approx(g["epsilon"]) and run["delta"] == pytest.approx(1e-5)
    assert 0 < g["epsilon"] <= 2.0 * (1 + 1e-9) and report["pate"]["queries_asked"] > 0
