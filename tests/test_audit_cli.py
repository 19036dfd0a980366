"""``veil audit``: the report it writes, ``--run`` on a finished ``veil train`` run, and bad input
(one line on stderr, exit status 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from veil.cli.main import main


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_audit_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "audit"
    code, stdout, _ = run(
        capsys,
        "audit", "--dataset", "digits", "--noise-multiplier", "0", "--epochs", "3",
        "--canaries", "100", "--attack", "all", "--shadow-models", "2", "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(stdout)
    assert report == json.loads((out / "report.json").read_text())
    assert report["epsilon_theoretical"] is None  # σ = 0 promises nothing
    assert report["non_private"]["epsilon_lower_bound"] >= 0 and report["confidence"] == 0.95
    assert (
        report["non_private"]["canaries"]["count"] == 100
        and report["non_private"]["canaries"]["gradient"]["bound"]["canaries"] == 100
    )
    for key in ("auc", "tpr_at_0.1pct_fpr", "tpr_at_1pct_fpr"):
        assert 0 <= report["non_private"]["mia"][key] <= 1
    assert (
        set(report["non_private"]["mia"]["attacks"]) == {"loss", "lira"}
        and report["non_private"]["mia"]["attack"] == "lira"
    )
    assert (
        report["non_private"]["run"]["non_private"] is True
        and report["non_private"]["run"]["noise_multiplier"] == 0
    )
    for name in ("report.html", "roc.png", "canaries.png"):
        assert (out / name).stat().st_size > 0
    # revH's H7: an audit releases nothing (its verdict is un-noised): no release/, all owner-only.
    assert not (out / "release").exists()
    assert all(p.stat().st_mode & 0o077 == 0 for p in [out, *out.rglob("*")])
    html = (out / "report.html").read_text()
    assert "promised ε" in html and "∞ (no noise)" in html and report["non_private"]["reading"][:40] in html


def test_audit_config_file_with_audit_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "audit.toml"
    cfg.write_text(
        'dataset = "digits"\nepsilon = 2.0\nepochs = 2\n\n[audit]\ncanaries = 60\nconfidence = 0.9\n'
    )
    code, stdout, _ = run(capsys, "audit", str(cfg), "--out", str(tmp_path / "a"), "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["confidence"] == 0.9 and report["non_private"]["canaries"]["count"] == 60
    assert report["epsilon_theoretical"] <= 2.0 + 1e-9
    assert report["non_private"]["epsilon_lower_bound"] <= report["epsilon_theoretical"]
    assert report["non_private"]["verdict"] == "consistent"


def test_audit_of_a_finished_train_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from veil import train

    run_dir = tmp_path / "run"
    trained = train(
        {"dataset": "digits", "epochs": 1, "baseline": False, "out": str(run_dir)}, progress=False
    )
    code, stdout, _ = run(capsys, "audit", "--run", str(run_dir), "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["epsilon_theoretical"] == pytest.approx(trained.epsilon_spent)
    assert (
        report["non_private"]["epsilon_lower_bound"] is None
        and report["non_private"]["verdict"] == "not_audited"
    )
    assert report["non_private"]["mia"]["attack"] == "loss"
    assert report["non_private"]["mia"]["members"] == trained.dataset.n_train
    assert report["non_private"]["mia"]["nonmembers"] == trained.dataset.n_test
    assert (run_dir / "audit" / "report.html").is_file()
    # LiRA needs shadow models only (the run's own settings and σ), not the run's training again.
    code, stdout, _ = run(
        capsys, "audit", "--run", str(run_dir), "--attack", "all", "--shadow-models", "2",
        "--out", str(tmp_path / "lira"), "--json",
    )  # fmt: skip
    assert code == 0 and set(json.loads(stdout)["non_private"]["mia"]["attacks"]) == {"loss", "lira"}
    # A second audit into the same folder is refused rather than overwriting the first.
    code, _, err = run(capsys, "audit", "--run", str(run_dir))
    assert code == 2 and "not empty" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--confidence", "1.5"], "confidence=1.5"),
        (["--confidence", "0"], "confidence=0.0"),
        (["--canaries", "100000"], "canaries=100000"),
        (["--canary-kind", "input", "--canaries", "1000"], "held-out"),
        (["--attack", "everything"], "attack='everything'"),
        (["--shadow-models", "1"], "shadow_models=1"),
        (["--epsilon", "inf", "--noise-multiplier", "0.5"], "noise_multiplier=0.5"),
        (["--epsilon", "2", "--noise-multiplier", "0"], "epsilon=2.0"),
        (["--model", "mlp", "--canaries", "900", "--delta", "6e-4"], "vacuous"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    out = tmp_path / "never"
    code, stdout, err = run(capsys, "audit", "--dataset", "digits", "--out", str(out), *args)
    assert code == 2 and stdout == ""
    assert err.startswith("veil: error: ") and err.count("\n") == 1 and needle in err
    assert not out.exists()


def test_run_of_a_folder_that_is_not_a_veil_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "stuff.txt").write_text("hello")
    code, _, err = run(capsys, "audit", "--run", str(tmp_path))
    assert code == 2 and "not a finished veil train run" in err and err.count("\n") == 1
    code, _, err = run(capsys, "audit", "--run", str(tmp_path / "missing"))
    assert code == 2 and "not a finished veil train run" in err


def test_unknown_audit_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "audit.toml"
    cfg.write_text('dataset = "digits"\n\n[audit]\ncanary = 10\n')
    code, _, err = run(capsys, "audit", str(cfg), "--out", str(tmp_path / "a"))
    assert code == 2 and "canary" in err
