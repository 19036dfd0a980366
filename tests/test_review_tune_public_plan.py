"""Adversarial review revH, H2/H3/H15: ``veil tune --validation-fraction F`` plans on a public size.

The trials were planned on the exact size of the training part (q = B/n_train, the steps, σ, the
preset's batch ⌈n_train/2⌉), published in ``release/report.json``; B > n_train was refused after
reading; an empty part divided by zero. The part's size is a function of every record's side of the
keyed split: between two neighbours with the same N, it differs by one when their extra records fall
on different sides. Now every trial is planned on n = ⌊(1 − F)·N⌋ (public N and F) and samples each
record of its part at q = B/n, fixed before any row is read.

Planted: pass the exact ``n_train`` to ``_admit``/``preset_candidate`` again in :func:`veil.tune.run.tune`
and ``test_neighbours_whose_extra_record_falls_on_either_side_get_one_plan`` fails (B/q tracks the part);
drop the ``n < 1`` refusal of :func:`veil.pipeline.data.check_delta` and ``test_check_delta_on_zero``
fails (ZeroDivisionError)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _budget_cli import cli
from tables_support import TWO_FEATURES_SCHEMA as SCHEMA
from veil.config import make_config
from veil.errors import DataError
from veil.pipeline.data import check_delta
from veil.tune.run import planned_size, validation_mask
from veil.tune.trial import prepare_trial


def _write(path: Path, rows: list[str]) -> None:
    path.write_text("a,b,label\n" + "\n".join(rows) + "\n")


def _sizes(path: Path, schema: Path) -> tuple[int, int]:
    """(N, exact training-part size) at F = 0.3, seed 0."""
    cfg = make_config({"dataset": f"csv:{path}", "table_schema": str(schema), "epsilon": 3.0, "seed": 0})
    full, _, _ = prepare_trial(cfg, None)
    return full.data.n_records, int((~validation_mask(full.data, 0.3, 0)).sum())


def _neighbours(folder: Path) -> tuple[Path, Path]:
    """D + r_a and D + r_b: the same N, r_a in the training part and r_b in the validation part."""
    schema = folder / "schema.toml"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 2))
    rows = [f"{r[0]:.4f},{r[1]:.4f},{int(r[0] > 0)}" for r in x]
    _write(folder / "D.csv", rows)
    n0, part0 = _sizes(folder / "D.csv", schema)
    found: dict[str, Path] = {}
    for k in range(400):
        probe = folder / "probe.csv"
        _write(probe, [*rows, f"0.{k:03d},0.5,1"])
        n1, part1 = _sizes(probe, schema)
        side = {(n0 + 1, part0 + 1): "a", (n0 + 1, part0): "b"}.get((n1, part1))
        if side is not None and side not in found:
            found[side] = probe.rename(folder / f"D{side}.csv")
        if len(found) == 2:
            return found["a"], found["b"]
    raise AssertionError("no pair of neighbours found")  # pragma: no cover


def _tune(capsys: pytest.CaptureFixture[str], data: Path, folder: Path) -> dict:
    out = folder / f"out-{data.stem}"
    code, stdout, err = cli(
        capsys, "tune", "--dataset", f"csv:{data}", "--schema", str(folder / "schema.toml"), "--lr", "0.1",
        "--epochs", "1", "--batch-size", "8", "--trials-mean", "1", "--validation-fraction", "0.3",
        "--no-compare-preset", "--epsilon", "3", "--delta", "1e-4", "--out", str(out),
    )  # fmt: skip
    assert code == 0, stdout + err
    return json.loads((out / "release" / "report.json").read_text())


def test_neighbours_whose_extra_record_falls_on_either_side_get_one_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    da, db = _neighbours(tmp_path)
    ra, rb = _tune(capsys, da, tmp_path), _tune(capsys, db, tmp_path)
    assert ra["tune"]["budget_split"] == rb["tune"]["budget_split"]
    assert ra["tune"]["search_space"] == rb["tune"]["search_space"]
    n_plan = planned_size(ra["tune"]["n_records"], 0.3)
    for shape in ra["tune"]["budget_split"]["shapes"]:
        assert shape["batch_size"] / shape["sampling_rate"] == pytest.approx(n_plan)
    planned = {(s["epochs"], s["batch_size"]): s["steps"] for s in ra["tune"]["budget_split"]["shapes"]}
    for report in (ra, rb):  # the candidate is drawn at random; its steps are its shape's, the same for both
        chosen = report["tune"]["chosen"]
        if chosen:
            assert chosen["steps"] == planned[(chosen["epochs"], chosen["batch_size"])]


def test_check_delta_on_zero() -> None:
    with pytest.raises(DataError, match="N = 0"):
        check_delta(1e-5, 0)


def test_planned_size_is_public() -> None:
    assert planned_size(458, 0.3) == 320 and planned_size(458, 0.0) == 458 and planned_size(2, 0.9) == 0


def test_the_engine_samples_each_record_at_the_public_rate() -> None:
    """``make_private(population=n)``: q = B/n and ⌈n/B⌉ steps per epoch over the dataset's own rows."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from veil.engine import PrivacyEngine
    from veil.errors import SamplingError

    rows = TensorDataset(torch.zeros(10, 3), torch.zeros(10, dtype=torch.long))
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    _, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(rows, batch_size=2), noise_multiplier=1.0, max_grad_norm=1.0, population=20,
    )  # fmt: skip
    assert engine.plan is not None
    assert (engine.plan.sampling_rate, engine.plan.steps_per_epoch) == (0.1, 10)
    assert sum(len(x) for x, _ in loader) <= 10 * 10  # drawn from the 10 rows, 10 steps
    model = nn.Linear(3, 2)
    with pytest.raises(SamplingError, match="population"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(rows, batch_size=2), noise_multiplier=1.0, max_grad_norm=1.0,
            population=20, poisson_sampling=False, allow_non_poisson=True,
        )  # fmt: skip
