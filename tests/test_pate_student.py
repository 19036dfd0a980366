"""The PATE student's semi-supervised step: post-processing only.

It must never read the public pool's true labels and must change nothing about the privacy
accounting: poisoning the pool's labels leaves the released labels, every ε and the student
unchanged, while switching the step on does change the student.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from veil.pate.run import run_pate
from veil.pate.student import train_student
from veil.pate.teachers import ModelRecipe


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.array([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    return (centres[y] + rng.normal(scale=1.0, size=(n, 2))).astype(np.float32), y


def test_self_training_uses_the_pool_and_is_skipped_without_probabilities() -> None:
    x, y = _blobs(600, 0)
    recipe = ModelRecipe("sklearn-logreg", (2,), 3, "table", None, seed=0)
    sup = train_student(x[:6], y[:6], x[300:], y[300:], recipe)
    semi = train_student(x[:6], y[:6], x[300:], y[300:], recipe, x_unlabelled=x[6:300], semi_supervised=True)
    assert not sup.semi_supervised and sup.pseudo_labelled == 0
    assert semi.semi_supervised and 0 < semi.pseudo_labelled <= 294 and semi.train_size == 6

    class NoProba:
        def fit(self, x: np.ndarray, y: np.ndarray) -> NoProba:
            self.c = int(np.bincount(y).argmax())
            return self

        def predict(self, x: np.ndarray) -> np.ndarray:
            return np.full(len(x), self.c)

    res = train_student(
        x[:6], y[:6], x[300:], y[300:], lambda i: NoProba(), x_unlabelled=x[6:300], semi_supervised=True
    )
    assert not res.semi_supervised and res.pseudo_labelled == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    from veil.data import load_dataset

    ds = load_dataset("digits", test_fraction=0.4, seed=2)
    x_pub, y_pub = ds.x_test[:300], ds.y_test[:300]  # held out: disjoint from the private part
    base = tmp_path_factory.mktemp("semi")
    files = {
        "true": y_pub,
        "shuffled": np.random.default_rng(1).permutation(y_pub),
        "poisoned": (y_pub + 1) % 10,
    }
    out: dict[str, tuple[object, Path]] = {}
    for name, labels in files.items():
        path = base / f"{name}.npz"
        np.savez(path, x=x_pub, y=labels)
        for semi in (True, False):
            if name != "true" and not semi:
                continue
            folder = base / f"{name}-{semi}"
            cfg = {
                "dataset": "digits",
                "teachers": 20,
                "aggregator": "gnmax",
                "sigma": 3.0,
                "epsilon": 8.0,
                "queries": 80,
                "public_data": str(path),
                "semi_supervised": semi,
                "seed": 2,
                "reproducible": True,  # equal labels across the runs need the same (seeded) noise
                "out": str(folder),
            }
            out[f"{name}-{semi}"] = (run_pate(cfg), folder)
    return out


def _predictions(folder: Path) -> np.ndarray:
    from veil.data import load_dataset

    with open(folder / "student.model", "rb") as fh:
        model = pickle.load(fh)
    return np.asarray(model.predict(load_dataset("digits", test_fraction=0.4, seed=2).x_test))


def test_the_pool_labels_are_never_read(runs: dict[str, tuple[object, Path]]) -> None:
    ref, ref_dir = runs["true-True"]
    for name in ("shuffled-True", "poisoned-True"):
        rep, folder = runs[name]
        a, b = np.load(ref_dir / "labels.npz"), np.load(folder / "labels.npz")
        assert np.array_equal(a["label"], b["label"]) and np.array_equal(a["public_index"], b["public_index"])
        assert np.array_equal(_predictions(ref_dir), _predictions(folder))
        assert rep.student_test_accuracy == ref.student_test_accuracy  # type: ignore[attr-defined]
        assert rep.label_accuracy != ref.label_accuracy  # type: ignore[attr-defined]  # the labels did differ


def test_semi_supervision_changes_the_student_and_nothing_about_privacy(
    runs: dict[str, tuple[object, Path]],
) -> None:
    on, on_dir = runs["true-True"]
    off, off_dir = runs["true-False"]
    assert on.student_semi_supervised and on.student_pseudo_labels > 0  # type: ignore[attr-defined]
    assert not off.student_semi_supervised and off.student_pseudo_labels == 0  # type: ignore[attr-defined]
    for key in ("epsilon", "epsilon_data_independent", "epsilon_data_dependent", "delta", "guarantee"):
        assert getattr(on, key) == getattr(off, key)
    assert np.array_equal(np.load(on_dir / "labels.npz")["label"], np.load(off_dir / "labels.npz")["label"])
    assert not np.array_equal(_predictions(on_dir), _predictions(off_dir))
