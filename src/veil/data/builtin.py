"""The datasets scikit-learn ships (no download): ``digits`` and ``breast-cancer``."""

from __future__ import annotations

import numpy as np

from veil.data import BUILTIN_PRESETS, Dataset, sha256_arrays, split

__all__ = ["load_builtin"]

# Public knowledge from the datasets' documentation (not computed from the data): digits are 8×8
# images whose pixels are integers in 0..16.
DIGITS_PIXEL_MAX = 16.0


def load_builtin(name: str, *, test_fraction: float, seed: int) -> Dataset:
    """``digits`` as 1×8×8 images (pixels 0..16), ``breast-cancer`` as a 30-feature table."""
    from sklearn import datasets

    if name == "digits":
        bunch = datasets.load_digits()
        x = np.asarray(bunch.data, dtype=np.float64)
        y = np.asarray(bunch.target, dtype=np.int64)
        digest = sha256_arrays(x, y)
        x_tr, y_tr, x_te, y_te = split(x.reshape(-1, 1, 8, 8).astype(np.float32), y, test_fraction, seed)
        return Dataset(
            name=name,
            kind="image",
            x_train=x_tr,
            y_train=y_tr,
            x_test=x_te,
            y_test=y_te,
            classes=[str(c) for c in bunch.target_names],
            sha256=digest,
            preset=BUILTIN_PRESETS[name],
            pixel_max=DIGITS_PIXEL_MAX,
        )
    bunch = datasets.load_breast_cancer()
    x = np.asarray(bunch.data, dtype=np.float64)
    y = np.asarray(bunch.target, dtype=np.int64)
    digest = sha256_arrays(x, y)
    x_tr, y_tr, x_te, y_te = split(x.astype(np.float32), y, test_fraction, seed)
    return Dataset(
        name=name,
        kind="table",
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        classes=[str(c) for c in bunch.target_names],
        sha256=digest,
        preset=BUILTIN_PRESETS[name],
        feature_names=[str(f) for f in bunch.feature_names],
    )
