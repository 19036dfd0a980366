"""The example-mixing probe never sees a private value (review revF, F3).

Probed on the first private rows, a model whose forward centres its batch (``x - x.mean(0)``) passed
when those rows coincided and was refused once one record was added: the run's exit code, folder and
release depended on one record. The probe now runs on public inputs only: synthetic values of the
public input shape (``veil train``: from the schema, before the budget is charged and before any row
is read; ``make_private``: random values shaped like the loader's items).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.cli.main import main
from veil.data import Dataset
from veil.engine import PrivacyEngine
from veil.errors import ModelNotSupportedError
from veil.mixing_probe import public_loaders
from veil.pipeline.public_inputs import refuse_mixing_on_public_inputs


class Centred(nn.Module):
    """Mixes examples: each output depends on the batch mean."""

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1).float()
        return self.lin(x - x.mean(0, keepdim=True))


MODELS = """
import torch
from torch import nn


class Centred(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.lin = nn.Linear(d, k)

    def forward(self, x):
        x = x.flatten(1)
        return self.lin(x - x.mean(0, keepdim=True))


def mixing(input_shape, num_classes):
    return Centred(input_shape[0], num_classes)


def plain(input_shape, num_classes):
    return nn.Linear(input_shape[0], num_classes)
"""


def _coinciding_rows(n: int = 40) -> np.ndarray:
    """A private table whose first rows coincide (a common record), the rest random."""
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    x[:12] = 0.25
    return x


def test_make_private_refuses_a_mixing_model_whatever_the_first_rows_hold() -> None:
    for x in (_coinciding_rows(), np.random.default_rng(1).normal(size=(40, 3)).astype(np.float32)):
        loader = DataLoader(
            TensorDataset(torch.from_numpy(x), torch.zeros(40, dtype=torch.long)), batch_size=8
        )
        model = Centred(3, 2)
        with pytest.raises(ModelNotSupportedError, match="mixes examples"):
            PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
            )


def test_make_private_keeps_a_model_that_does_not_mix() -> None:
    x = torch.from_numpy(_coinciding_rows())
    loader = DataLoader(TensorDataset(x, torch.zeros(40, dtype=torch.long)), batch_size=8)
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert engine.plan is not None


def _table(x: np.ndarray) -> Dataset:
    y = np.zeros(len(x), dtype=np.int64)
    return Dataset("t", "table", x, y, x[:2], y[:2], ["a", "b"], "", "table")


def test_the_pipeline_probe_refuses_on_synthetic_inputs_not_the_rows() -> None:
    """The rows coincide: a probe on them sees no mixing (planted error: probe ``data.x_train``)."""
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        refuse_mixing_on_public_inputs(Centred(3, 2), _table(_coinciding_rows()), seed=0)
    refuse_mixing_on_public_inputs(nn.Linear(3, 2), _table(_coinciding_rows()), seed=0)


def test_public_loaders_keep_structure_and_dtypes_never_values() -> None:
    items = [{"input_ids": torch.full((5,), 900), "attention_mask": torch.ones(5, dtype=torch.long),
              "labels": torch.tensor(1)}] * 3  # fmt: skip
    model = nn.Embedding(30, 2)
    loaders = public_loaders(DataLoader(items), model)
    assert not isinstance(loaders, str)
    for loader in loaders:
        batch = next(iter(DataLoader(loader.dataset, batch_size=4, collate_fn=loader.collate_fn)))
        assert batch["input_ids"].shape[1] in (8, 32) and batch["input_ids"].dtype == torch.long
        assert int(batch["input_ids"].max()) < 30 and 900 not in batch["input_ids"]  # valid, none of the 900s
        assert bool((batch["attention_mask"] == 1).all())
        assert set(batch["labels"].tolist()) <= {0, 1}
    texts = public_loaders(DataLoader(["private text of a person", "another"]), model)
    assert not isinstance(texts, str) and "person" not in str(texts[0].dataset)  # public stand-ins
    listed = public_loaders(DataLoader([{"input_ids": [900] * 6, "attention_mask": [1] * 6}] * 3), model)
    assert not isinstance(listed, str)
    rows = [item["input_ids"] for item in listed[0].dataset]  # type: ignore[attr-defined]
    assert all(max(r) < 30 for r in rows) and len({tuple(r) for r in rows}) > 1  # items differ


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: list[list[int]], text: bool = False) -> None:
        self.rows, self.text = rows, text

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        if self.text:  # a raw text beside the ids, dropped by the collate
            return torch.tensor(self.rows[i]), torch.tensor(i % 2), "a private sentence"
        return torch.tensor(self.rows[i]), torch.tensor(i % 2)


def _pad(items: list[Any]) -> Any:
    width = max(len(item[0]) for item in items)
    ids = [nn.functional.pad(item[0], (0, width - len(item[0]))) for item in items]
    return torch.stack(ids), torch.stack([item[1] for item in items])


class _MixesWhenLong(nn.Module):
    """Mixes examples only on batches padded to ≥ 6 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        return self.out(h + h.mean(0, keepdim=True) if x.shape[1] >= 6 else h)


class _MixesOnLargeIds(nn.Module):
    """Mixes examples through the tokens whose id is above 1."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, real = self.emb(x), (x > 1).unsqueeze(-1).float()
        return self.out((h + (h * real).sum((0, 1), keepdim=True) / (real.sum() + 1)).mean(1))


class _MixesOnPixels(nn.Module):
    """Centres the batch only when every input is non-negative."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0, keepdim=True) if bool((x >= 0).all()) else x)


def _made_private(model: nn.Module, dataset: Any, collate: Any = None) -> None:
    PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=4, collate_fn=collate),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )


def test_the_engine_probe_never_takes_a_length_from_the_first_item() -> None:
    """Neighbours whose first token list has 3 or 8 tokens: the same verdict (refused), since the
    probe runs at public lengths (planted error: the first item's length; revG F4)."""
    rest = [[3, 4, 5]] * 19
    for first in ([7, 8, 9], [7, 8, 9, 10, 11, 12, 13, 14]):
        with pytest.raises(ModelNotSupportedError, match="mixes examples"):
            _made_private(_MixesWhenLong(), _Tokens([first, *rest]), _pad)


def test_the_engine_probe_draws_ids_over_the_vocabulary_and_floats_over_public_ranges() -> None:
    """A model mixing only on ids above 1, or only on non-negative inputs, is refused (revG F3:
    ids 0/1 and standard normal floats passed both)."""
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        _made_private(_MixesOnLargeIds(), _Tokens([[3, 4, 5]] * 20), _pad)
    pixels = TensorDataset(torch.rand(20, 5), torch.randint(0, 2, (20,)))
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        _made_private(_MixesOnPixels(), pixels)
    _made_private(nn.Linear(5, 2), pixels)  # a per-example model still passes


def test_the_engine_probe_runs_on_items_holding_text() -> None:
    """Items carrying a raw string (an HF dataset's ``text`` column) are probed with public texts,
    not skipped (revG F2: skipping let a mixing model train)."""
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        _made_private(_MixesOnLargeIds(), _Tokens([[3, 4, 5]] * 20, text=True), _pad)


def _files(tmp_path: Path, first: str | None) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    rows = ["age,y", *["40,a"] * 12, *[f"{rng.integers(18, 90)},{'ab'[rng.integers(2)]}" for _ in range(200)]]
    if first is not None:
        rows.insert(1, first)
    data = tmp_path / "data.csv"
    data.write_text("\n".join(rows) + "\n")
    schema = tmp_path / "s.toml"
    schema.write_text(
        'reviewed = true\n[columns.age]\ntype = "numeric"\nbounds = [18.0, 100.0]\n'
        '[columns.y]\nrole = "target"\nclasses = ["a", "b"]\n'
    )
    return data, schema


def _train(tmp_path: Path, data: Path, schema: Path, model: str) -> int:
    return main(["train", "--dataset", f"csv:{data}", "--schema", str(schema), "--model", model,
                 "--epsilon", "1", "--delta", "1e-4", "--epochs", "1", "--batch-size", "32",
                 "--no-baseline", "--out", str(tmp_path / "run")])  # fmt: skip


@pytest.mark.parametrize("first", [None, "62,b"])
def test_train_refuses_a_mixing_model_for_either_neighbour_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], first: str | None
) -> None:
    import veil.pipeline.data

    (tmp_path / "probe_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a private row was read before the mixing model was refused")

    monkeypatch.setattr(veil.pipeline.data, "load_data", no_reading)
    data, schema = _files(tmp_path, first)
    code = _train(tmp_path, data, schema, "probe_models:mixing")
    _, err = capsys.readouterr()
    assert code == 2 and "mixes examples" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    assert main(["budget", "show"]) == 0
    shown, _ = capsys.readouterr()
    assert "committed" not in shown  # refused before the charge


def test_train_keeps_a_model_that_does_not_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "probe_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data, schema = _files(tmp_path, None)
    code = _train(tmp_path, data, schema, "probe_models:plain")
    _, err = capsys.readouterr()
    assert code == 0, err
