"""The data of a ``veil pate`` run: the private part (teachers), the public pool (the student's
unlabelled queries, in a seeded order) and the test set.

A built-in or user dataset is loaded by :func:`veil.data.load_dataset`; its training part is the
private data. The public pool is data declared public: ``public_data`` (a file of public examples,
which must share no row with the private data), or — for a built-in benchmark only — its documented
public split, the held-out part (the test images, as the PATE papers use them), split, fixed by
``seed`` and stratified, into the pool (``public_fraction``) and the test set. A user dataset without
``public_data`` is refused (:func:`require_public_pool`) before a row is read: its held-out rows are
private rows, and the student, fitted on the pool without noise, would release them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from veil.errors import ConfigError, DataError
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from veil.data import Dataset
    from veil.pate.config import PateConfig

__all__ = ["PateData", "load_pate_data", "load_public_data", "require_public_pool"]


def require_public_pool(cfg: PateConfig) -> None:
    """Refuse, before any row is read, a run whose public pool would be cut from private data (a user
    dataset, not a built-in benchmark, without ``public_data``) or would be empty (a declared
    ``public_data`` file without rows: a public fact, so refused here rather than after reading)."""
    from veil.data import BUILTIN

    if cfg.public_data is not None:
        if len(load_public_data(cfg.public_data)[0]) == 0:
            raise DataError(
                "public_data",
                cfg.public_data,
                "the public pool holds no example, so there is nothing for the student to query",
                "pass a file with at least one public example",
            )
        return
    if cfg.dataset not in BUILTIN:
        raise ConfigError(
            "public_data",
            None,
            f"the student is fitted without noise on the public pool, so a pool cut from '{cfg.dataset}' "
            "would release private rows; only a built-in benchmark has a documented public split",
            "pass --public-data FILE (.npz with x, or .npy) of examples that are public",
        )


def load_public_data(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Public examples from ``.npz`` (``x``, optional ``y``) or ``.npy``."""
    p = Path(path)
    if not p.is_file():
        raise DataError("public_data", str(p), "the file does not exist", "pass an .npz or .npy file")
    try:
        if p.suffix == ".npy":
            return np.asarray(np.load(p, allow_pickle=False)), None
        with np.load(p, allow_pickle=False) as z:
            if "x" not in z:
                raise DataError(
                    "public_data", str(p), f"no array named 'x' (found {sorted(z.files)})", "save it as x="
                )
            return np.asarray(z["x"]), (np.asarray(z["y"]) if "y" in z else None)
    except (OSError, ValueError) as exc:
        raise DataError(
            "public_data", str(p), f"not a readable numpy file ({exc})", "pass .npz/.npy"
        ) from None


@dataclass(frozen=True)
class PateData:
    """The private part, the public pool (and the queries drawn from it), the test set."""

    ds: Dataset
    x_pub: np.ndarray
    y_pub: np.ndarray | None
    x_test: np.ndarray
    y_test: np.ndarray
    split: str
    duplicates: int
    order: np.ndarray
    """The public pool's rows in query order (the first ``len(order)`` are asked)."""

    @property
    def x_queries(self) -> np.ndarray:
        return self.x_pub[self.order]

    @property
    def y_queries(self) -> np.ndarray | None:
        return self.y_pub[self.order] if self.y_pub is not None else None


def _split_holdout(
    x: np.ndarray, y: np.ndarray, public_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    n = len(y)
    n_pub = round(public_fraction * n)
    if n_pub < 1 or n - n_pub < 1:
        raise DataError(
            "public_fraction",
            public_fraction,
            f"the {n} held-out examples leave no public pool or no test set",
            "use more data or a different public_fraction",
        )
    counts = np.bincount(y)
    strat = y if counts[counts > 0].min() >= 2 and min(n_pub, n - n_pub) >= len(counts) else None
    i_pub, i_test = train_test_split(
        np.arange(n), train_size=n_pub, random_state=derive_seed(seed, Purpose.PATE_HOLDOUT), stratify=strat
    )
    return x[i_pub], y[i_pub], x[i_test], y[i_test]


def _given_public_pool(cfg: PateConfig, ds: Dataset) -> tuple[np.ndarray, np.ndarray | None, str]:
    from veil.pate.partition import check_public_shape

    assert cfg.public_data is not None
    x_pub, y_pub = load_public_data(cfg.public_data)
    check_public_shape(ds.x_train, x_pub, what="public_data")
    x_pub = x_pub.astype(ds.x_train.dtype, copy=False)
    if y_pub is not None and (y_pub.shape[0] != x_pub.shape[0]):
        y_pub = None
    split = (
        f"private: the training examples of '{ds.name}'; public pool: {len(x_pub)} examples from "
        f"{cfg.public_data} (public by declaration); test: the held-out examples"
    )
    return x_pub, y_pub, split


def load_pate_data(cfg: PateConfig) -> PateData:
    from veil.data import load_dataset
    from veil.pate.partition import count_shared_rows

    ds = load_dataset(
        cfg.dataset,
        data_dir=cfg.data_dir,
        target=cfg.target,
        test_fraction=cfg.holdout_fraction,
        seed=cfg.seed,
        classes=cfg.classes,
    )
    if cfg.public_data is not None:
        x_pub, y_pub, split = _given_public_pool(cfg, ds)
        x_test, y_test = ds.x_test, ds.y_test
    else:
        x_pub, y_pub, x_test, y_test = _split_holdout(ds.x_test, ds.y_test, cfg.public_fraction, cfg.seed)
        split = (
            f"private: the training examples of '{ds.name}'; the benchmark's public split, "
            f"its {ds.n_test} held-out examples, split (seed {cfg.seed}, stratified) into a public pool "
            f"of {len(x_pub)} (labels hidden from the student, used only to score the released labels) "
            f"and a test set of {len(x_test)}"
        )
    duplicates = count_shared_rows(ds.x_train, x_pub)  # non-private: reported in non_private only
    # The pool is never empty here: a declared file was checked before reading
    # (require_public_pool), a benchmark's split keeps at least one example (_split_holdout).
    q_planned = min(cfg.queries or len(x_pub), len(x_pub))
    order = np.random.default_rng(derive_seed(cfg.seed, Purpose.PATE_QUERIES)).permutation(len(x_pub))[
        :q_planned
    ]
    return PateData(ds, x_pub, y_pub, x_test, y_test, split, duplicates, order)
