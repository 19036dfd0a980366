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
    "--preset-share",  # one trial shape, so the exact accounting check below is of that shape
    "0",
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
    # The run's duration grows with K (review): only in non_private, never in the released report.
    assert "duration_s" not in r and "duration_s" not in r["tune"] and r["non_private"]["duration_s"] > 0
    released = json.loads((out / "release" / "report.json").read_text())
    assert "duration_s" not in json.dumps({k: v for k, v in released.items() if k != "non_private"})
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
    # A score noise of std 2 alone costs more than ε = 0.05 (the automatic plan, scoring every training
    # row, would choose a std large enough to fit).
    code = main(["tune", "--epsilon", "0.05", "--score-noise", "2", "--out", str(out), *TINY])
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


def test_only_the_tune_itself_has_a_release_folder(tuned: tuple[Path, dict]) -> None:
    """The trials and the preset reference are trained by the train job, which writes a release/
    folder claiming its own guarantee for every run; the tuning bound covers only the chosen model,
    and the reference is charged nowhere, so tune runs both without publishing (found by the review)."""
    out, _ = tuned
    assert [p.relative_to(out) for p in out.rglob("release")] == [Path("release")]


def test_the_chosen_model_is_compared_with_the_preset_non_privately(tuned: tuple[Path, dict]) -> None:
    """veil train's preset ran on the whole training split at the same ε: its test accuracy and the
    difference are in ``non_private`` only, its model deleted; the plan is public and says its price."""
    out, r = tuned
    ref = r["non_private"]["preset_reference"]
    assert ref is not None and 0.0 <= ref["test_accuracy"] <= 1.0 and ref["model"] == "rff"
    assert r["non_private"]["chosen_minus_preset"] == pytest.approx(
        r["non_private"]["test_accuracy"] - ref["test_accuracy"]
    )
    assert "preset_reference" not in r and not list((out / "reference").rglob("*.pt"))
    public = json.loads((out / "release" / "report.json").read_text())
    assert "preset_reference" not in json.dumps({k: v for k, v in public.items() if k != "non_private"})
    plan = r["budget_split"]["plan"]
    assert plan["chosen_by"] == "partly auto" and plan["trials_mean"] == 1.5  # given; score noise automatic
    assert plan["score_noise_std"] == r["budget_split"]["score_noise_std"] >= 2.0
    assert plan["reference_noise_multiplier"] == pytest.approx(ref["sigma"])
    ratio = plan["trial_noise_multiplier"] / plan["reference_noise_multiplier"]
    assert plan["noise_ratio"] == pytest.approx(ratio) and "veil train" in plan["advice"]
    assert "Chosen minus preset" in (out / "report.html").read_text()
    assert "points against veil train's preset on the" in r["non_private"]["recommendation"]
    assert "recommendation" not in json.dumps({k: v for k, v in public.items() if k != "non_private"})
    assert "ordered by chance" in plan["advice"] and plan["selection_resolution_points"] > 0


def test_the_recommendation_reads_the_difference_against_the_test_splits_resolution() -> None:
    """Twice the binomial standard error of the preset's accuracy on the test rows: 0.75 on 200 rows
    gives ±6.1 points; below it 'did not pay', within it 'did not clearly pay', above it 'paid'."""
    from veil.tune.report import verdict

    band = 200 * (0.75 * 0.25 / 200) ** 0.5
    assert band == pytest.approx(6.12, abs=0.01)
    assert verdict(-0.07, 0.75, 200).startswith("Tuning did not pay") and "±6.1" in verdict(-0.07, 0.75, 200)
    assert verdict(-0.05, 0.75, 200).startswith("Tuning did not clearly pay")
    assert verdict(0.05, 0.75, 200).startswith("Tuning did not clearly pay")
    assert verdict(0.07, 0.75, 200).startswith("Tuning paid")
    assert "prefer `veil train`" in verdict(-0.07, 0.75, 200)


def test_the_selection_resolution_is_the_score_noise_and_the_rows_sampling() -> None:
    """std of the difference of two equal candidates' noisy scores: √2 · √((s/n)² + 1/(4n)), in points."""
    from veil.accounting.tuning import TrialCount
    from veil.tune.plan import TrialPlan

    plan = TrialPlan(TrialCount(2.0, "negative_binomial", 0.0), 24.0, 7.0, 10.0, "auto", 800.0)
    assert plan.resolution_points == pytest.approx(100 * (2 * (0.03**2 + 1 / 3200)) ** 0.5)
    assert plan.score_points == pytest.approx(3.0)


def test_on_large_data_the_automatic_score_is_quiet_where_it_costs_no_noise() -> None:
    """Fashion-MNIST's shape (60,000 rows scored, the scattering preset's 240 steps at q = 16384/60000):
    the plan takes a score std of 0.2% of the rows (0.2 accuracy points, within the rows' own sampling)
    at the same trial σ as the old 3% score (1,800: a 3-point std that made the selection chance) and
    with the same mean number of trials (3) as the old menu chose."""
    from veil.accounting.calibrate import calibrate_noise
    from veil.tune.budget import split_budget
    from veil.tune.plan import MAX_NOISE_RATIO, choose_plan
    from veil.tune.trial import score_event

    n = 60000
    shape = (60, 16384, 16384 / n, 240)
    ref = calibrate_noise(3.0, 1e-5, shape[2], shape[3])
    plan = choose_plan(3.0, 1e-5, shape, [], n, ref)
    assert plan.count.mean == 3.0 and plan.noise_ratio <= MAX_NOISE_RATIO
    assert plan.score_noise == pytest.approx(0.002 * n) and plan.score_points == pytest.approx(0.2)
    loud = split_budget(3.0, 1e-5, plan.count, [shape], [], score_event(0.03 * n)).shapes[0].sigma
    assert plan.trial_sigma == pytest.approx(loud, rel=1e-3)


def test_a_benchmark_tuned_preset_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """digits with the default space: the job says tuning will not pay before a row is read or ε spent."""
    import veil.tune.run as tune_run

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("read the data")

    monkeypatch.setattr(tune_run, "prepare_trial", must_not_read)
    db, out = tmp_path / "budget.db", tmp_path / "t"
    code = main(["tune", "--dataset", "digits", "--epsilon", "3", "--db", str(db), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "veil train --dataset digits --epsilon 3" in err and "--tune-anyway" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["budget", "show", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []  # nothing charged


def test_the_preset_is_a_candidate_drawn_with_its_share() -> None:
    """Around the preset: lr halved/doubled, epochs halved; the preset drawn with probability 1/2
    (plus the grid's own 1/6 chance of the same values). 6,000 secure draws, bound ± 6 sd: a false
    failure has probability below 1e-8."""
    from veil.tune.space import Candidate, around_preset

    preset = Candidate(lr=0.8, epochs=10, batch_size=256, max_grad_norm=1.0, model="rff")
    space = around_preset(preset)
    assert space.lr == (0.4, 0.8, 1.6) and space.epochs == (5, 10) and space.batch_size == (256,)
    assert space.budget_shapes == [(5, 256), (10, 256)]
    n = 6000
    hits = sum(space.draw() == preset for _ in range(n))
    p = 0.5 + 0.5 / 6
    assert abs(hits - n * p) < 6 * (n * p * (1 - p)) ** 0.5, hits
    only = around_preset(preset, {"lr": (0.1,), "epochs": (1,)}, preset_share=1.0)
    assert all(only.draw() == preset for _ in range(50))
    assert only.budget_shapes == [(1, 256), (10, 256)]  # the preset's shape is always planned for
    never = around_preset(preset, {"lr": (0.1,)}, preset_share=0.0)
    assert all(d.lr == 0.1 for d in (never.draw() for _ in range(50)))
    with pytest.raises(Exception, match="preset_share"):
        SearchSpace(preset_share=0.5)


def test_the_automatic_plan_is_the_largest_mean_within_its_noise_price() -> None:
    """From public settings only (ε, δ, the preset's shape, the validation size, veil train's σ): the
    largest mean of the menu whose trial σ is within MAX_NOISE_RATIO of one run's, and the plan fits ε."""
    from veil.accounting.calibrate import calibrate_noise
    from veil.accounting.tuning import TrialCount
    from veil.errors import UnreachableTargetError
    from veil.tune.budget import split_budget
    from veil.tune.plan import MAX_NOISE_RATIO, MEANS, MIN_SCORE_NOISE, SCORE_SHARES, choose_plan
    from veil.tune.trial import score_event

    shape, n_val = (10, 256, 256 / 1150, 45), 287
    ref = calibrate_noise(3.0, 1e-5, 256 / 1437, 57)
    plan = choose_plan(3.0, 1e-5, shape, [], n_val, ref)
    assert plan.chosen_by == "auto" and plan.count.law == "negative_binomial" and plan.count.shape == 0
    assert plan.noise_ratio <= MAX_NOISE_RATIO and plan.count.mean in MEANS
    split = split_budget(3.0, 1e-5, plan.count, [shape], [], score_event(plan.score_noise))
    assert split.epsilon <= 3.0 and split.shapes[0].sigma == pytest.approx(plan.trial_sigma)
    for mean in [m for m in MEANS if m > plan.count.mean]:  # every larger mean costs too much noise
        for share in SCORE_SHARES:
            noise = max(MIN_SCORE_NOISE, share * n_val)
            try:
                s = split_budget(
                    3.0, 1e-5, TrialCount(mean, "negative_binomial", 0.0), [shape], [], score_event(noise)
                )
            except UnreachableTargetError:
                continue
            assert s.shapes[0].sigma / ref > MAX_NOISE_RATIO


def test_the_preset_reference_never_looks_releasable_even_when_the_tune_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference is trained at the target ε and charged nowhere (review revD F5): it writes no
    ``release/`` folder at any time, and its weights are deleted also when the tune fails right after
    it trained (here: an error raised once its run folder is written)."""
    import veil.training.execute as execute

    real = execute.execute_run
    seen: list[tuple[bool, bool]] = []

    def fails_after_the_reference(plan, run_dir, ledger, *args, **kwargs):  # type: ignore[no-untyped-def]
        report = real(plan, run_dir, ledger, *args, **kwargs)
        if ledger.header.get("job") == "tune-reference":
            seen.append(((run_dir / "release").exists(), (run_dir / "model.pt").is_file()))
            raise RuntimeError("the tune fails after the reference trained")
        return report

    monkeypatch.setattr(execute, "execute_run", fails_after_the_reference)
    monkeypatch.setattr(TrialCount, "sample", lambda self: 1)
    out = tmp_path / "run"
    argv = ["tune", "--dataset", "breast-cancer", "--epsilon", "3", "--out", str(out), "--epochs", "1",
            "--batch-size", "128", "--model", "logreg", "--lr", "1.0", "--max-grad-norm", "1",
            "--preset-share", "0", "--trials-mean", "2", "--score-noise", "10"]  # fmt: skip
    with pytest.raises(RuntimeError, match="after the reference"):
        main(argv)
    assert seen == [(False, True)]  # trained and written, with no release/ of its own at any time
    reference = out / "reference"
    assert reference.is_dir() and not list(reference.rglob("*.pt")) and not list(reference.rglob("release"))
