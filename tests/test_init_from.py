"""``veil train --init-from CHECKPOINT --fine-tune head|last-k|full`` on digits (vision models).

The checkpoints are seeded random weights saved with ``torch.save(state_dict)``: public (they never
saw a row), which is what ``--init-from`` declares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from veil.cli.main import main
from veil.models import build_model

COMMON = ["--dataset", "digits", "--epochs", "1", "--no-baseline", "--reproducible", "--json"]


class TwoPart(nn.Module):
    """Not a plain Sequential: frozen layers are trained through (requires_grad=False), not precomputed."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Linear(64, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.body(x.flatten(1))))


def two_part(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return TwoPart(num_classes)


def _checkpoint(path: Path, model: str, classes: int = 10) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    shape = (1, 8, 8)
    net = two_part(shape, classes) if model == "two_part" else build_model(model, shape, classes, "image")
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(state, path)
    return state


def _run(out: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["train", *COMMON, "--out", str(out), *args])
    return code, capsys.readouterr().err


def _released(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    return state, json.loads((out / "report.json").read_text())


def test_head_trains_only_the_classifier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path / "mlp.pt", "mlp")
    code, err = _run(tmp_path / "run", capsys, "--model", "mlp", "--init-from", str(tmp_path / "mlp.pt"))
    assert code == 0, err
    state, report = _released(tmp_path / "run")
    # mlp = Flatten, Linear "1", Tanh, Linear "3": the front (frozen, buffers) then the head.
    assert torch.equal(state["net.features.1.weight"], ckpt["1.weight"])  # bit-identical
    assert torch.equal(state["net.features.1.bias"], ckpt["1.bias"])
    assert not torch.equal(state["net.head.0.weight"], ckpt["3.weight"])  # the head moved
    pre = report["pretrained"]
    assert pre["trained_layers"] == ["3"] and pre["frozen_layers"] == ["1"]
    assert pre["features_computed_once"] and pre["reinitialised"] == []
    assert pre["declared_public_by"].startswith("--init-from")
    assert report["parameters"] == 64 * 10 + 10
    assert "public by the user's declaration" in report["covers"]
    assert all(c["passed"] for c in report["checks"] if c["name"] != "secure_randomness")


def test_new_class_count_reinitialises_the_classifier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path / "mlp5.pt", "mlp", classes=5)
    code, err = _run(tmp_path / "run", capsys, "--model", "mlp", "--init-from", str(tmp_path / "mlp5.pt"))
    assert code == 0, err
    state, report = _released(tmp_path / "run")
    assert report["pretrained"]["reinitialised"] == ["3.weight", "3.bias"]
    assert state["net.head.0.weight"].shape == (10, 64)
    assert torch.equal(state["net.features.1.weight"], ckpt["1.weight"])


def test_last_k_on_the_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _checkpoint(tmp_path / "cnn.pt", "cnn")
    args = ["--model", "cnn", "--init-from", str(tmp_path / "cnn.pt"), "--fine-tune", "last-k"]
    args += ["--last-k", "2"]
    code, err = _run(tmp_path / "run", capsys, *args)
    assert code == 0, err
    state, report = _released(tmp_path / "run")
    pre = report["pretrained"]
    assert pre["trained_layers"] == ["0.5", "1"] and pre["frozen_layers"] == ["0.0", "0.1", "0.4"]
    # Flattened layers: conv 0, GroupNorm 1, tanh, pool, conv 4 | GroupNorm, tanh, pool, flatten, linear.
    for mine, theirs in (("0", "0.0"), ("1", "0.1"), ("4", "0.4")):
        for kind in ("weight", "bias"):
            assert torch.equal(state[f"net.features.{mine}.{kind}"], ckpt[f"{theirs}.{kind}"])
    assert not torch.equal(state["net.head.4.weight"], ckpt["1.weight"])
    assert report["parameters"] == 32 * 2 + 128 * 10 + 10


def test_full_and_a_model_that_is_not_a_sequential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path / "two.pt", "two_part")
    model = ["--model", "test_init_from:two_part", "--init-from", str(tmp_path / "two.pt")]
    code, err = _run(tmp_path / "head", capsys, *model, "--fine-tune", "head")
    assert code == 0, err
    state, report = _released(tmp_path / "head")
    assert not report["pretrained"]["features_computed_once"]  # frozen by requires_grad, run each step
    assert torch.equal(state["net.body.weight"], ckpt["body.weight"])
    assert not torch.equal(state["net.out.weight"], ckpt["out.weight"])
    assert report["parameters"] == 16 * 10 + 10
    code, err = _run(tmp_path / "full", capsys, *model, "--fine-tune", "full")
    assert code == 0, err
    state, report = _released(tmp_path / "full")
    assert report["pretrained"]["frozen_layers"] == []
    assert not torch.equal(state["net.body.weight"], ckpt["body.weight"])
    assert report["parameters"] == 64 * 16 + 16 + 16 * 10 + 10


def test_a_run_on_the_same_data_is_refused_another_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(tmp_path / "first", capsys, "--model", "mlp")
    assert code == 0, err
    code, err = _run(tmp_path / "again", capsys, "--model", "mlp", "--init-from", str(tmp_path / "first"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "same dataset" in err, err
    assert not (tmp_path / "again").exists()
    # The same weights used for other data (a digits subset saved as npz): accepted.
    from sklearn.datasets import load_digits

    digits = load_digits()
    import numpy as np

    np.savez(tmp_path / "d.npz", x=digits.images[:600, None].astype("float32") / 16, y=digits.target[:600])
    args = ["train", "--dataset", f"npz:{tmp_path / 'd.npz'}", "--classes", ",".join(map(str, range(10)))]
    args += ["--model", "mlp", "--init-from", str(tmp_path / "first" / "model.pt"), "--epochs", "1"]
    args += ["--no-baseline", "--reproducible", "--delta", "1e-4", "--out", str(tmp_path / "other")]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "other" / "report.json").read_text())
    assert report["pretrained"]["source_run_dataset"] == "digits"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "cnn", "--init-from", "{tmp}/module.pt"], "pickled module"),
        (["--model", "mlp", "--init-from", "{tmp}/cnn.pt"], "do not fit"),
        (["--model", "cnn", "--init-from", "{tmp}/nope.pt"], "no such weights file"),
        (["--model", "cnn", "--fine-tune", "last-k"], "--init-from"),
        (["--model", "cnn", "--init-from", "{tmp}/cnn.pt", "--fine-tune", "lora"], "Hugging Face"),
    ],
)
def test_bad_checkpoints_exit_2_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    _checkpoint(tmp_path / "cnn.pt", "cnn")
    torch.save(build_model("cnn", (1, 8, 8), 10, "image"), tmp_path / "module.pt")
    code, err = _run(tmp_path / "run", capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def _npz_run(tmp_path: Path, name: str, data: Path, *extra: str) -> tuple[int, str]:
    """``veil train`` on an npz digits subset (a private file, so the registry charges it)."""
    args = ["train", "--dataset", f"npz:{data}", "--classes", ",".join(map(str, range(10)))]
    args += ["--model", "mlp", "--epochs", "1", "--no-baseline", "--reproducible", "--delta", "1e-4"]
    return main([*args, "--out", str(tmp_path / name), *extra]), ""


def _digits_npz(path: Path) -> Path:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(path, x=digits.images[:400, None].astype("float32") / 16, y=digits.target[:400])
    return path


def test_a_released_model_is_refused_on_its_rows_under_any_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """revH's H11: ``release/model.pt`` copied elsewhere (no ledger, no report beside it), used on a
    byte-identical copy of the data under the same ``--dataset-id``, or on the copy without one (its
    fingerprint is recorded for the name): refused before a row is read, nothing charged. The same
    copy on other data is accepted."""
    import shutil

    from veil.registry.store import BudgetRegistry

    data = _digits_npz(tmp_path / "d.npz")
    code, _ = _npz_run(tmp_path, "first", data, "--dataset-id", "clinic")
    assert code == 0, capsys.readouterr().err
    (tmp_path / "published").mkdir()
    shutil.copy(tmp_path / "first" / "release" / "model.pt", tmp_path / "published" / "weights.pt")
    shutil.copy(data, tmp_path / "copy.npz")
    for name, extra in (("named", ["--dataset-id", "clinic"]), ("by-content", [])):
        code, _ = _npz_run(
            tmp_path,
            name,
            tmp_path / "copy.npz",
            *extra,
            "--init-from",
            str(tmp_path / "published" / "weights.pt"),
        )
        err = capsys.readouterr().err
        assert code == 2 and "same dataset" in err and "budget registry records" in err, err
        assert not (tmp_path / name).exists()
    with BudgetRegistry() as registry:
        assert len(registry.status("name:clinic").runs) == 1  # the refused runs charged nothing
    # Other rows: the weights are public for them.
    import numpy as np

    other = tmp_path / "other.npz"
    with np.load(data) as d:
        np.savez(other, x=d["x"][:300] * 0.5, y=d["y"][:300])
    code, _ = _npz_run(
        tmp_path, "other-run", other, "--init-from", str(tmp_path / "published" / "weights.pt")
    )
    assert code == 0, capsys.readouterr().err


def test_a_copied_release_folder_names_its_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied ``release/`` folder, used where the registry has no record of its files (another
    registry): its ``report.json`` names the dataset (``dataset_budget.dataset_id``), refused."""
    import shutil

    data = _digits_npz(tmp_path / "d.npz")
    code, _ = _npz_run(tmp_path, "first", data, "--dataset-id", "clinic")
    assert code == 0, capsys.readouterr().err
    shutil.copytree(tmp_path / "first" / "release", tmp_path / "published")
    shutil.copy(data, tmp_path / "copy.npz")
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "another-registry.db"))
    weights = str(tmp_path / "published" / "model.pt")
    code, _ = _npz_run(
        tmp_path, "again", tmp_path / "copy.npz", "--dataset-id", "clinic", "--init-from", weights
    )
    err = capsys.readouterr().err
    assert code == 2 and "report beside it names dataset name:clinic" in err, err
    assert not (tmp_path / "again").exists()


def test_a_copied_model_with_its_ledger_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review revJ J9: a run's ``model.pt`` copied with its ``ledger.jsonl`` (no report beside it), the
    run charged in another registry, on the same rows: refused before reading, nothing charged (it was
    refused only after the data was read, the run charged). Planted: drop the ledger check in
    :func:`veil.models.pretrained.refuse_released_here` and the registry holds a run."""
    import shutil

    from veil.registry.store import BudgetRegistry

    data = _digits_npz(tmp_path / "d.npz")
    code, _ = _npz_run(tmp_path, "first", data, "--dataset-id", "clinic")
    assert code == 0, capsys.readouterr().err
    (tmp_path / "copy").mkdir()
    for name in ("model.pt", "ledger.jsonl"):
        shutil.copy(tmp_path / "first" / name, tmp_path / "copy" / name)
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "another-registry.db"))
    weights = str(tmp_path / "copy" / "model.pt")
    code, _ = _npz_run(tmp_path, "again", data, "--dataset-id", "clinic", "--init-from", weights)
    err = capsys.readouterr().err
    assert code == 2 and "ledger beside it was charged to dataset name:clinic" in err, err
    assert not (tmp_path / "again").exists()
    with BudgetRegistry() as registry:
        assert not registry.status("name:clinic").runs
