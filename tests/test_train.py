"""``veil train`` end to end: the whole flow on digits and breast-cancer, precedence, budget stop, resume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from veil.accounting.ledger import Ledger
from veil.cli.main import main
from veil.config import load_config_file, make_config

REPORT_FIELDS = {
    "epsilon_spent", "target_epsilon", "delta", "accountant", "noise_multiplier", "max_grad_norm", "sampling",
    "sampling_rate", "steps", "epochs", "dataset", "model", "label_set", "randomness", "release_ready",
    "covers", "seed", "veil_version", "duration_s", "checks", "non_private",
}  # fmt: skip
CHECKS = {
    "epsilon_reported",
    "delta_below_1_over_n",
    "poisson_sampling_matches_accountant",
    "per_sample_clipping",
    "secure_randomness",
    "no_unaccounted_data_use",
}


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One small digits run through the CLI: a config file (5 epochs, cnn) overridden by --epochs 2."""
    root = tmp_path_factory.mktemp("digits")
    config = root / "train.toml"
    config.write_text('dataset = "digits"\nmodel = "cnn"\nepochs = 5\nepsilon = 3.0\n')
    out = root / "run"
    code = main(["train", str(config), "--epochs", "2", "--out", str(out), "--json"])
    assert code == 0
    return out, json.loads((out / "report.json").read_text())


def test_digits_flow_report_and_files(digits_run: tuple[Path, dict[str, Any]]) -> None:
    out, report = digits_run
    assert set(report) >= REPORT_FIELDS
    assert report["epochs"] == 2 and report["model"] == "cnn"  # flag over file, file over default
    assert report["sampling"] == "poisson" and report["accountant"] == "pld"
    assert 0 < report["epsilon_spent"] <= report["target_epsilon"] == 3.0
    assert (
        set(report["dataset"]) >= {"name", "n_train", "n_test", "sha256"}
        and report["dataset"]["n_train"] + report["dataset"]["n_test"] == 1797
    )
    n = report["dataset"]["n_train"]
    assert report["steps"] == report["steps_planned"] == 2 * math.ceil(n / report["batch_size"])
    assert math.isclose(report["sampling_rate"], report["batch_size"] / n)
    assert report["randomness"] == "secure" and report["release_ready"] is True
    assert report["label_set"]["source"] == "declared" and len(report["label_set"]["classes"]) == 10
    internal = report["non_private"]
    assert 0 <= internal["test_accuracy"] <= 1 and 0 <= internal["baseline_test_accuracy"] <= 1
    assert math.isclose(
        internal["utility_drop"], internal["baseline_test_accuracy"] - internal["test_accuracy"]
    )
    assert {c["name"] for c in report["checks"]} == CHECKS and all(c["passed"] for c in report["checks"])
    for name in (
        "report.json",
        "report.html",
        "epsilon.png",
        "curves.png",
        "config.toml",
        "ledger.jsonl",
        "model.pt",
    ):
        assert (out / name).is_file(), name
    assert list((out / "checkpoints").glob("step-*.pt"))
    ledger = Ledger.open(out / "ledger.jsonl")
    assert ledger.steps == report["steps"]
    saved = make_config(load_config_file(out / "config.toml"))
    assert saved.epochs == 2 and saved.model == "cnn" and saved.batch_size == report["batch_size"]


def test_digits_model_weights_reload_and_reproduce_accuracy(digits_run: tuple[Path, dict[str, Any]]) -> None:
    from veil.data import load_dataset
    from veil.data.preprocess import build_transform, plan_preprocessing
    from veil.models import build_model

    out, report = digits_run
    state = torch.load(out / "model.pt", weights_only=True)
    data = load_dataset("digits", seed=report["seed"])
    plan = plan_preprocessing(make_config({}), data)
    model = torch.nn.Sequential()
    model.add_module("preprocess", build_transform(plan, data.input_shape))
    model.add_module("net", build_model("cnn", data.input_shape, data.num_classes, data.kind))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_test)).argmax(1).numpy()
    accuracy = report["non_private"]["test_accuracy"]
    assert math.isclose(float((pred == data.y_test).mean()), accuracy, abs_tol=1e-9)


def test_breast_cancer_flow_charges_dp_preprocessing(tmp_path: Path) -> None:
    import veil
    import veil.training  # the module is named apart from the function: veil.train stays the function

    report = veil.train(
        {"dataset": "breast-cancer", "epsilon": 1.0, "epochs": 3, "out": str(tmp_path / "bc")}, progress=False
    )
    assert report.epsilon_spent <= 1.0 and report.target_epsilon == 1.0
    assert report.preprocessing["method"] == "dp-center" and report.preprocessing["public"] is False
    assert report.all_checks_passed and report.baseline_test_accuracy is not None
    ledger = Ledger.open(tmp_path / "bc" / "ledger.jsonl")
    kinds = [r["kind"] for r in ledger.records]
    # The preprocessing release is charged before it happens, and before any step.
    assert kinds.index("event") < kinds.index("preprocessing") < kinds.index("step")
    assert ledger.events()[0].to_dict() == report.preprocessing["event"]
    assert (tmp_path / "bc" / "preprocessing.json").is_file()


def test_given_noise_multiplier_stops_before_the_budget(tmp_path: Path) -> None:
    """With a small σ the run stops at the last step that fits; one more step would pass the target."""
    import dp_accounting as dpa

    from veil.training import train

    report = train(
        {
            "noise_multiplier": 1.5,
            "epsilon": 2.0,
            "epochs": 5,
            "model": "logreg",
            "baseline": False,
            "out": str(tmp_path / "r"),
        },
        progress=False,
    )
    assert report.stopped_early and report.steps < report.steps_planned
    assert report.epsilon_spent <= 2.0

    def eps(steps: int) -> float:  # an independent accountant (Google's dp_accounting, PLD)
        acc = dpa.pld.PLDAccountant()
        event = dpa.PoissonSampledDpEvent(report.sampling_rate, dpa.GaussianDpEvent(report.noise_multiplier))
        acc.compose(dpa.SelfComposedDpEvent(event, steps))
        return float(acc.get_epsilon(report.delta))

    assert eps(report.steps) <= 2.0 * 1.01
    assert eps(report.steps + 1) > 2.0 * 0.99


def test_resume_of_a_finished_run_adds_no_step(digits_run: tuple[Path, dict[str, Any]], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out, report = digits_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    code, stdout, _ = run_cli(["train", "--resume", str(copy), "--json", "--no-baseline"], capsys)
    assert code == 0
    again = json.loads(stdout)
    assert again["steps"] == report["steps"] and again["epsilon_spent"] == report["epsilon_spent"]
    assert again["resumes"] == 1 and again["non_private"]["baseline_test_accuracy"] is None
    assert np.isclose(again["non_private"]["test_accuracy"], report["non_private"]["test_accuracy"])


def test_train_with_one_run_audit(tmp_path: Path) -> None:
    """`veil train --audit`: the report carries an empirical lower bound next to the promised ε."""
    from veil.cli.main import main

    out = tmp_path / "audited"
    args = ["train", "--dataset", "digits", "--epochs", "2", "--no-baseline", "--audit", "--out", str(out)]
    code = main([*args, "--json"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    audit = report["non_private"]["audit"]
    assert audit["confidence"] == 0.95
    assert audit["epsilon_theoretical"] == report["epsilon_spent"]
    # A sound lower bound stays below the promise (false alarm ≤ 5% by construction; seeded run).
    assert 0.0 <= audit["epsilon_lower_bound"] <= report["epsilon_spent"]
    assert "Empirical audit" in (out / "report.html").read_text()


def test_npz_with_fewer_training_rows_than_the_preset_batch_trains_at_q_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The preset batch is cut to N, so q = 1: every step is accounted as the plain Gaussian, by the
    engine and the ledger alike (they used to disagree and the run died after writing its ledger)."""
    from veil.accounting.calibrate import dpsgd_epsilon
    from veil.accounting.events import Gaussian, event_from_dict

    rng = np.random.default_rng(0)
    data = tmp_path / "small.npz"
    np.savez(data, x=rng.integers(0, 256, (60, 8, 8), dtype=np.uint8), y=np.arange(60) % 3)
    out = tmp_path / "run"
    args = ["train", "--dataset", f"npz:{data}", "--classes", "0,1,2", "--epochs", "3", "--out", str(out)]
    code, _, err = run_cli([*args, "--json", "--no-baseline"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    n = report["dataset"]["n_train"]
    assert n < 256 and report["batch_size"] == n and report["sampling_rate"] == 1.0
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    sampling = next(c for c in report["checks"] if c["name"] == "poisson_sampling_matches_accountant")
    assert "q = 1" in sampling["detail"]
    ledger = Ledger.open(out / "ledger.jsonl")
    steps = [event_from_dict(r["event"]) for r in ledger.of_kind("step")]
    sigma = report["noise_multiplier"]
    assert len(steps) == report["steps"] == 3 and set(steps) == {Gaussian(sigma)}
    expected = dpsgd_epsilon(1.0, sigma, report["steps"], report["delta"])
    assert report["epsilon_spent"] == pytest.approx(expected, rel=1e-9)
    assert expected <= report["target_epsilon"] == 3.0
    ledger.close()
