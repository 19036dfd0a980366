"""The H15 residue: ``veil tune`` whose keyed split leaves the real training part empty.

The trials are planned on the public size ⌊(1 − F)·N⌋ (:func:`veil.tune.run.planned_size`), while the
part's exact size is private: whether it is 0 depends on every record's side of the split. The
engine refused an empty dataset in one line when the first trial started, a refusal after private
rows were read. Now ``make_private(population=)`` runs on zero rows: every planned step is taken (an
update of pure noise) and charged, and the run's outputs have the shape of a run on a non-empty part.

Planted: restore the ``n < 1`` refusal in :func:`veil.engine.planning.check_data_loader` and
``test_an_empty_training_part_runs_like_a_non_empty_one`` and
``test_the_engine_takes_its_steps_on_zero_rows`` fail (exit 2, "dataset='empty'"); take the template
item from ``dataset[0]`` again in :func:`veil.engine.wrapping.template_item` and both fail
(IndexError)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from _budget_cli import cli
from tables_support import TWO_FEATURES_SCHEMA as SCHEMA
from veil.engine import PrivacyEngine
from veil.errors import DataError, InvalidParameterError

# Four rows each on the training side of the train/test split and in the validation part at F = 0.3,
# seed 0 (checked below through the report's n_train): the planned size is ⌊0.7 · 4⌋ = 2, so the one
# candidate (1 epoch, batch 1; no preset) takes 2 steps.
ALL_HELD_OUT = ["0.003,0.5,1", "0.007,0.5,1", "0.008,0.5,0", "0.010,0.5,0"]
SOME_TRAINED = ["0.001,0.5,1", "0.002,0.5,0", "0.003,0.5,1", "0.008,0.5,0"]  # two trained, two held out


def _tune(capsys: pytest.CaptureFixture[str], folder: Path, name: str, rows: list[str]) -> tuple[Path, str]:
    data = folder / f"{name}.csv"
    data.write_text("a,b,label\n" + "\n".join(rows) + "\n")
    out = folder / name
    code, stdout, err = cli(
        capsys, "tune", "--dataset", f"csv:{data}", "--schema", str(folder / "schema.toml"), "--lr", "0.1",
        "--epochs", "1", "--batch-size", "1", "--trials-mean", "1", "--validation-fraction", "0.3",
        "--no-compare-preset", "--preset-share", "0", "--epsilon", "3", "--delta", "1e-2", "--out", str(out),
    )  # fmt: skip
    assert code == 0, stdout + err
    return out, stdout


def _lines(stdout: str, out: Path) -> str:
    """The job's messages with its folder and every figure blanked."""
    return re.sub(r"\d[\d.]*", "#", stdout.replace(str(out), "OUT"))


def _files(out: Path) -> set[str]:
    """The run folder's file names, checkpoints by kind (the candidate's steps are drawn at random)."""
    return {re.sub(r"step-\d+", "step-#", str(p.relative_to(out))) for p in out.rglob("*")}


def _shape(value: object) -> object:
    """The report's structure: keys and list lengths, no values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__ if value is not None else "null"


def test_an_empty_training_part_runs_like_a_non_empty_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    empty, out_empty = _tune(capsys, tmp_path, "empty", ALL_HELD_OUT)
    some, out_some = _tune(capsys, tmp_path, "some", SOME_TRAINED)
    r_empty = json.loads((empty / "report.json").read_text())
    r_some = json.loads((some / "report.json").read_text())
    assert r_empty["non_private"]["n_train"] == 0 and r_some["non_private"]["n_train"] > 0  # the premise
    assert r_empty["tune"]["n_records"] == r_some["tune"]["n_records"] == 4
    assert _files(empty) == _files(some)
    assert (empty / "release" / "model.pt").is_file()
    released = [json.loads((d / "release" / "report.json").read_text()) for d in (empty, some)]
    for r in released:
        r["dataset_budget"]["runs"] = r["dataset_budget"]["runs"][-1:]  # one registry for both runs
    assert _shape(released[0]) == _shape(released[1])
    assert _lines(out_empty, empty) == _lines(out_some, some)
    # every planned step was taken on the empty part and charged to the trial's ledger
    ledger = [json.loads(line) for line in (empty / "trials" / "1" / "ledger.jsonl").read_text().splitlines()]
    steps = [e for e in ledger if e["kind"] == "step"]
    trial = r_empty["non_private"]["trials"][0]
    assert len(steps) == trial["steps"] == 2 and trial["within_plan"]


def test_the_engine_takes_its_steps_on_zero_rows() -> None:
    """``population`` given: a zero-row ``TensorDataset`` yields empty batches, each step a noisy update."""
    rows = TensorDataset(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(rows, batch_size=2), noise_multiplier=1.0, max_grad_norm=1.0, population=8,
    )  # fmt: skip
    for x, y in loader:
        assert x.shape == (0, 3) and y.shape == (0,)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.steps == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_without_a_population_an_empty_dataset_is_refused() -> None:
    """Its size is then the planned one, public: refused before anything is built."""
    model = nn.Linear(3, 2)
    with pytest.raises(DataError, match="empty"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2),
            noise_multiplier=1.0, max_grad_norm=1.0,
        )  # fmt: skip


class _Listed(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3), 0


@pytest.mark.parametrize("n", [0, 5])
def test_a_population_needs_a_template_from_structure_whatever_the_size(n: int) -> None:
    """A dataset with no structural template is refused with a population, on its type alone."""
    model = nn.Linear(3, 2)
    with pytest.raises(InvalidParameterError, match="template_item"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_Listed(n), batch_size=2), noise_multiplier=1.0, max_grad_norm=1.0,
            population=8,
        )  # fmt: skip
