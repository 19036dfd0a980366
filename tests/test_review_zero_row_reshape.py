"""revK K3 + K5: steps after reading that flattened examples with ``reshape(len(x), -1)``.

numpy cannot infer ``-1`` from an array of 0 rows, so each such step failed at 0 rows and worked at
1 — where the number of rows is private (``veil tune``'s trial part; PATE on the user's own IDX
files) one record decided whether anything was released (K3: ``tune`` with the ``dp-center``
preprocessing raised after its charge; K5: ``veil pate`` on float IDX files raised a traceback).
Every such site now takes the row size from the public example shape
(:func:`veil.data.rows.flat_rows`).

Planted: ``-1`` back in :func:`veil.data.preprocess.run_preprocessing` makes
``test_tune_dp_center_on_an_empty_part_releases_like_its_neighbour`` fail (ValueError); ``-1`` back
in ``veil.data.idx._pixels_in_range`` makes ``test_pate_on_float_idx_files_of_0_and_1_images`` fail."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from _budget_cli import cli
from veil.data.rows import flat_rows


def test_flat_rows_takes_zero_rows() -> None:
    assert flat_rows(np.zeros((0, 1, 4, 4))).shape == (0, 16)
    assert flat_rows(np.zeros((0,)), (3, 2)).shape == (0, 6)
    assert flat_rows(np.ones((2, 3, 2))).shape == (2, 6)


def test_each_flattening_step_takes_zero_rows() -> None:
    from veil.audit.coordinates import _per_example_vmap
    from veil.data import row_hashes
    from veil.data.idx import _pixels_in_range
    from veil.pate.partition import _canonical_rows
    from veil.pate.teachers import _scale

    assert _pixels_in_range(np.zeros((0, 28, 28), dtype=">f4")).shape == (0,)
    assert _scale(np.zeros((0, 1, 4, 4)), 255.0).shape == (0, 16)
    assert _canonical_rows(np.zeros((0, 2, 3))).shape == (0, 6)
    assert row_hashes(np.zeros((0, 3)), [], "d", 0) == []
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    grads = _per_example_vmap(model, torch.zeros(0, 1, 2, 2), torch.zeros(0, dtype=torch.long))
    assert grads.shape == (0, 10)


def test_tune_dp_center_on_an_empty_part_releases_like_its_neighbour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's k6: a no-schema npz table (the ``dp-center`` preprocessing); E's 6 training rows
    all fall in the validation part, E1 moves one record to the trial part (same N)."""
    from veil.data.tabular import load_user
    from veil.tune.run import tune, validation_mask

    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 2)).astype(np.float32)
    y = (np.arange(200) % 2).astype(np.int64)
    np.savez(tmp_path / "cand.npz", x=x, y=y)
    data = load_user(
        "npz", str(tmp_path / "cand.npz"), target=None, test_fraction=0.2, seed=0, classes=["0", "1"]
    )
    val = validation_mask(data, 0.5, 0)
    xv, yv, xt, yt = data.x_train[val], data.y_train[val], data.x_train[~val], data.y_train[~val]
    np.savez(tmp_path / "E.npz", x=xv[:6], y=yv[:6])
    np.savez(tmp_path / "E1.npz", x=np.concatenate([xv[:5], xt[:1]]), y=np.concatenate([yv[:5], yt[:1]]))
    seen = []
    for name in ("E", "E1"):
        monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / f"{name}.reg"))
        result = tune(
            dataset=f"npz:{tmp_path / name}.npz", epsilon=20.0, delta=1e-2, out=tmp_path / f"out-{name}",
            dims={"lr": (0.1,), "epochs": (1,), "batch_size": (1,)}, trials_mean=1, validation_fraction=0.5,
            extra={"classes": ["0", "1"]}, preset_share=0.0, compare_preset=False,
        )  # fmt: skip
        seen.append(
            (
                sorted(p.name for p in (tmp_path / f"out-{name}" / "release").iterdir()),
                result.get("preprocessing", {}).get("method"),
            )
        )
    assert seen[0] == seen[1]
    assert "model.pt" in seen[0][0]


def _idx(path: Path, a: np.ndarray, code: int) -> None:
    dtype = np.dtype(np.uint8) if code == 0x08 else np.dtype(">f4")
    path.write_bytes(
        bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(dtype).tobytes()
    )


def test_pate_on_float_idx_files_of_0_and_1_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reviewer's k11: ``--dataset fashion-mnist --data-dir DIR`` (N private) with the training
    images stored as float32; 0 images and 1 image both release labels and a student."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "pub.npz", x=rng.uniform(0, 255, size=(20, 1, 28, 28)).astype(np.float32))
    released = []
    for n in (0, 1):
        folder = tmp_path / f"dir{n}"
        folder.mkdir()
        _idx(folder / "train-images-idx3-ubyte", rng.uniform(0, 255, size=(n, 28, 28)), 0x0D)
        _idx(folder / "train-labels-idx1-ubyte", np.zeros(n), 0x08)
        _idx(folder / "t10k-images-idx3-ubyte", np.full((3, 28, 28), 7.0), 0x0D)
        _idx(folder / "t10k-labels-idx1-ubyte", np.zeros(3), 0x08)
        code, stdout, err = cli(
            capsys, "pate", "--dataset", "fashion-mnist", "--data-dir", str(folder),
            "--public-data", str(tmp_path / "pub.npz"), "--teachers", "3", "--epsilon", "8", "--sigma", "5",
            "--delta", "1e-5", "--workers", "1", "--queries", "5", "--out", str(tmp_path / f"out{n}"),
        )  # fmt: skip
        assert code == 0, stdout + err
        released.append(sorted(p.name for p in (tmp_path / f"out{n}" / "release").iterdir()))
    assert released[0] == released[1]
