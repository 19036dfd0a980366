"""``veil train --augment K`` end to end, its refusals, and ``--clip adaptive`` across a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from veil.cli.main import main

DIGITS = ["train", "--dataset", "digits", "--epochs", "1", "--batch-size", "256", "--no-baseline"]


def test_train_augment_runs_the_grouped_step_with_the_same_accounting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 3 (logistic regression on shifted images: the wiring; the CNN's exactness is tested in
    test_augment_multiplicity against a naive loop): every physical batch holds 3 rows per sampled
    example, the clipper returns one norm per example, and the accounting is the plain run's."""
    from veil.clipping.clipper import PerSampleClipper

    seen: list[tuple[int, int]] = []
    original = PerSampleClipper.accumulate

    def spy(self: PerSampleClipper) -> torch.Tensor:
        rows = {c.record.batch_size for c in self._calls}
        norms = original(self)
        seen.append((self.group_size, len(norms), *rows) if rows else (self.group_size, len(norms), 0))
        return norms

    monkeypatch.setattr(PerSampleClipper, "accumulate", spy)
    out = tmp_path / "k3"
    assert main([*DIGITS, "--model", "logreg", "--augment", "3", "--out", str(out), "--json"]) == 0
    report = json.loads((out / "report.json").read_text())
    grouped = [s for s in seen if s[0] == 3]
    assert grouped and all(rows == 3 * n for _, n, rows in grouped)
    assert any(n > 0 for _, n, _ in grouped)
    # The accounting is the plain run's: σ, q and the steps do not depend on K.
    from veil.config import make_config
    from veil.training.prepare import prepare_run

    plain = prepare_run(
        make_config({"dataset": "digits", "model": "logreg", "epochs": 1, "batch_size": 256}),
        None,
        check=False,
    )
    assert report["noise_multiplier"] == plain.steps.sigma and report["sampling_rate"] == plain.steps.q
    assert report["steps"] == plain.steps.steps_planned and report["epsilon_spent"] <= 3.0
    assert (out / "model.pt").is_file()
    assert report["clipping"] == {"mode": "fixed", "max_grad_norm": 1.0, "augment": 3, "augment_flip": False}
    assert "K = 3 augmented views per example" in (out / "report.html").read_text()
    assert "augment = 3" in (out / "config.toml").read_text()


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--model", "rff"], "fixed feature front"),  # features computed once: copies never reach it
        (["--model", "cnn", "--augment", "0"], "≥ 1"),
    ],
)
def test_train_augment_refusals_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], why: str
) -> None:
    out = tmp_path / "run"
    args = [*DIGITS, "--augment", "2", *extra, "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
    assert not out.exists()


def fixed_front_factory(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """A user's model that trains as a head on fixed features (the zoo's rff, from a factory)."""
    from veil.models import build_model

    return build_model("rff", input_shape, num_classes, "image")


def test_train_augment_on_a_factory_with_a_fixed_front_is_refused_before_the_charge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Known from the factory's code and the built-in dataset's documented shape: refused before a row
    is read, so the budget registry holds no run for it."""
    from _budget_cli import show

    out = tmp_path / "run"
    args = [*DIGITS, "--augment", "2", "--model", "test_train_augment:fixed_front_factory", "--out", str(out)]
    assert main(args) == 2
    assert "fixed feature front" in capsys.readouterr().err and not out.exists()
    assert show(capsys, "digits")["runs"] == []


def test_train_augment_is_refused_for_tables(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--dataset", "breast-cancer", "--augment", "2", "--no-baseline", "--out", str(out)]
    assert main(args) == 2 and not out.exists()


def test_adaptive_clip_norm_resumes_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run interrupted after its checkpoint at step 4 resumes with C at the checkpointed value (not
    the initial one), and the clipper and optimizer use it from the first resumed step."""
    import veil.pipeline.loop as loop
    import veil.training.execute  # noqa: F401  (bound to the real evaluate_released before the patch below)
    from veil.clipping.adaptive import AdaptiveClipping
    from veil.pipeline import checkpoints as ckpt

    out = tmp_path / "run"
    args = [
        "train", "--dataset", "digits", "--model", "logreg", "--epochs", "2", "--batch-size", "256",
        "--max-grad-norm", "20", "--clip", "adaptive", "--target-quantile", "0.5", "--no-baseline",
    ]  # fmt: skip
    (out.parent / "cfg.toml").write_text("checkpoint_every = 2\n")

    class Crash(RuntimeError):
        pass

    def crash(*_: Any, **__: Any) -> Any:
        raise Crash  # at the first evaluation (step 6): the last checkpoint is step 4

    monkeypatch.setattr(loop, "evaluate_released", crash)
    with pytest.raises(Crash):
        main([args[0], str(out.parent / "cfg.toml"), *args[1:], "--out", str(out)])
    monkeypatch.undo()
    from veil.accounting.ledger import Ledger

    ledger = Ledger.open(out / "ledger.jsonl", repair=True)
    saved = ckpt.load_checkpoint(out, ledger)
    ledger.close()
    assert saved is not None and saved["charged"] == 4
    saved_clip = saved["adaptive_clip"]["clip"]
    assert saved_clip < 20 * 0.9  # it moved from the initial 20 towards the median norm
    assert len(saved["adaptive_clip"]["history"]) == 4

    restored: list[tuple[float, float, float]] = []
    original = AdaptiveClipping.restore

    def spy(self: AdaptiveClipping, state: dict[str, Any]) -> None:
        original(self, state)
        restored.append(
            (self.state.clip, self.optimizer.clipper.max_grad_norms[0], self.optimizer.max_grad_norm)
        )

    monkeypatch.setattr(AdaptiveClipping, "restore", spy)
    assert main(["train", "--resume", str(out), "--json"]) == 0
    assert restored == [(saved_clip, saved_clip, saved_clip)]
    report = json.loads((out / "report.json").read_text())
    assert report["resumes"] == 1 and report["epsilon_spent"] <= report["target_epsilon"]
    clipping = report["clipping"]
    assert clipping["mode"] == "adaptive" and clipping["target_quantile"] == 0.5
    assert clipping["max_grad_norm"] == 20 and 0 < clipping["final_clip"] < 20
    page = (out / "report.html").read_text()
    assert "adaptive, following the 0.5 quantile" in page and f"final C {clipping['final_clip']:.4g}" in page
