"""Datasets for ``veil train``: built-in ones and readers for the user's own files.

What is read here is *private* (the training split is what the guarantee protects), so this package
only loads, checks and splits; it computes no statistic of the data. Scaling uses public knowledge
only (a pixel's documented range, bounds the user declares); everything else a model needs from the
data is bought with privacy budget in :mod:`veil.data.preprocess` and written to the ledger.

Names accepted by :func:`load_dataset`:

* ``digits`` (default) and ``breast-cancer``: shipped with scikit-learn, nothing to download;
* ``fashion-mnist`` and ``mnist``: IDX files (gzipped or not) from ``data_dir`` (default for
  fashion-mnist: the Debian package ``dataset-fashion-mnist``'s ``/usr/share/datasets/fashion-mnist``);
* ``csv:PATH``, ``parquet:PATH`` (needs pyarrow), ``npz:PATH``: the user's data, labels in ``target``;
* with ``schema`` (a reviewed table schema, :mod:`veil.tables`): ``csv:PATH``, ``parquet:PATH`` or
  ``sql:URL`` (with ``table`` or ``query``), read and encoded through the schema, whose target column and
  classes are the labels.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from veil.errors import ConfigError, DataError

__all__ = [
    "BUILTIN",
    "DEFAULT_DATA_DIRS",
    "Dataset",
    "check_labels",
    "encode_labels",
    "load_dataset",
    "split",
]

BUILTIN = ("digits", "breast-cancer", "fashion-mnist", "mnist")
USER_SCHEMES = ("csv", "parquet", "npz")
DEFAULT_DATA_DIRS = {
    "fashion-mnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
}


@dataclass
class Dataset:
    """A split dataset, features as raw float32 values (preprocessing lives in the model)."""

    name: str
    kind: Literal["image", "table"]
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]
    sha256: str
    preset: str
    feature_names: list[str] | None = None
    encoder: Any = None
    """The table encoder (:class:`veil.tables.encoder.TableEncoder`) when the data was read through a
    schema: its features are already clipped and scaled by public declarations, and it is saved with
    the model so that new rows are encoded the same way."""
    pixel_max: float | None = None
    """Public maximum pixel value (images): the documented range of the format, not a data statistic."""
    notes: list[str] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])


def sha256_arrays(*arrays: np.ndarray) -> str:
    """A fingerprint of arrays (dtype, shape and bytes), for the report's audit trail."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def encode_labels(raw: list[Any] | np.ndarray, where: str) -> tuple[np.ndarray, list[str]]:
    """Class indices 0..K-1 and the class names (sorted numerically when all are numbers)."""
    values = [
        str(v).strip() if not isinstance(v, (int, np.integer)) else str(int(v))
        for v in np.asarray(raw).ravel()
    ]
    for i, v in enumerate(values):
        if v == "" or v.lower() in ("nan", "none", "null"):
            raise DataError(
                f"{where} row {i + 1}",
                v,
                "an example without a label cannot be trained "
                "on, and dropping it silently changes the dataset",
                "fill in or remove the rows without a label",
            )

    def key(v: str) -> tuple[int, float, str]:
        try:
            return (0, float(v), v)
        except ValueError:
            return (1, 0.0, v)

    classes = sorted(set(values), key=key)
    index = {c: i for i, c in enumerate(classes)}
    return np.array([index[v] for v in values], dtype=np.int64), classes


def check_labels(y: np.ndarray, classes: list[str], where: str) -> None:
    """Refuse a single class and fewer examples than classes."""
    if len(classes) < 2:
        raise DataError(
            where,
            f"1 class ({classes[0] if classes else 'none'})",
            "a classifier needs at least two classes to learn anything",
            "check the target column, or add examples of the other classes",
        )
    if len(y) < 2 * len(classes):
        raise DataError(
            where,
            f"{len(y)} examples for {len(classes)} classes",
            "there are fewer examples than classes can be trained and tested on (at least two per class on "
            "average are needed)",
            "provide more examples (at least a few per class)",
        )


def split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A train/test split fixed by ``seed``, stratified by class when every class has ≥ 2 examples."""
    n = len(y)
    n_test = round(test_fraction * n)
    if n_test < 1 or n - n_test < 1:
        raise DataError(
            "dataset",
            f"{n} examples",
            f"a test fraction of {test_fraction} leaves no example on one side of the split",
            "provide more examples or change test_fraction",
        )
    counts = np.bincount(y)
    stratify = (
        y if counts[counts > 0].min() >= 2 and n_test >= len(counts) and n - n_test >= len(counts) else None
    )
    from sklearn.model_selection import train_test_split

    idx_train, idx_test = train_test_split(
        np.arange(n), test_size=n_test, random_state=seed, shuffle=True, stratify=stratify
    )
    missing = sorted(set(np.unique(y).tolist()) - set(np.unique(y[idx_train]).tolist()))
    if missing:
        raise DataError(
            "dataset",
            f"class index {missing[0]}",
            "a class has no example in the training split, so fewer training examples than classes are seen",
            "provide more examples of every class",
        )
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def load_dataset(
    name: str,
    *,
    data_dir: str | None = None,
    target: str | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    schema: str | None = None,
    table: str | None = None,
    query: str | None = None,
) -> Dataset:
    """Load, check and split the dataset called ``name`` (see the module docstring)."""
    if schema is not None or name.startswith("sql:"):
        return _load_with_schema(name, schema, target, table, query, test_fraction, seed)
    if ":" in name:
        scheme, _, path = name.partition(":")
        if scheme not in USER_SCHEMES or not path:
            raise ConfigError(
                "dataset",
                name,
                "unknown data source, so the data that the guarantee protects cannot be identified",
                f"use one of {', '.join(s + ':PATH' for s in USER_SCHEMES)} "
                f"or a built-in dataset ({', '.join(BUILTIN)})",
            )
        from veil.data.tabular import load_user

        return load_user(scheme, path, target=target, test_fraction=test_fraction, seed=seed)
    if name in ("digits", "breast-cancer"):
        from veil.data.builtin import load_builtin

        return load_builtin(name, test_fraction=test_fraction, seed=seed)
    if name in ("fashion-mnist", "mnist"):
        from veil.data.idx import load_idx_dataset

        return load_idx_dataset(name, data_dir or DEFAULT_DATA_DIRS[name])
    close = difflib.get_close_matches(name, BUILTIN, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        "dataset",
        name,
        "unknown dataset name",
        f"{hint}use one of {', '.join(BUILTIN)}, or csv:PATH, parquet:PATH, npz:PATH with --target",
    )


def _load_with_schema(
    name: str,
    schema: str | None,
    target: str | None,
    table: str | None,
    query: str | None,
    test_fraction: float,
    seed: int,
) -> Dataset:
    """A table read and encoded through its reviewed schema (see :mod:`veil.tables.dataset`)."""
    from veil.tables.sources import hide_password, url_has_password

    shown = "sql:" + hide_password(name[4:]) if name.startswith("sql:") else name
    if schema is None:
        raise ConfigError(
            "dataset",
            shown,
            "a SQL table's columns, levels, bounds and classes must be declared before it is read",
            "pass --schema SCHEMA.toml (draft one with `veil schema infer`, then review it)",
        )
    if name.startswith("sql:") and url_has_password(name[4:]):
        raise ConfigError(
            "dataset",
            shown,
            "the run folder records the dataset (config.toml, report), and a password in the URL would "
            "be written there beside the released model",
            "leave the password out of the URL and give it to the driver another way (PostgreSQL: the "
            "PGPASSWORD environment variable or ~/.pgpass)",
        )
    if name.partition(":")[0] not in ("csv", "parquet", "sql"):
        raise ConfigError(
            "dataset",
            name,
            "a schema describes a table",
            "use csv:PATH, parquet:PATH or sql:URL with --schema",
        )
    from veil.tables.dataset import load_schema_table
    from veil.tables.schema import load_schema

    declared = load_schema(schema).target
    if target is not None and (declared is None or declared.name != target):
        raise ConfigError(
            "target",
            target,
            f"the schema's target column is {declared.name if declared else 'not declared'}",
            "drop --target (the schema says which column is the label) or fix the schema",
        )
    loaded = load_schema_table(name, schema, table=table, query=query)
    x, y, classes = loaded.encoded.x, loaded.encoded.y, loaded.encoded.classes
    assert y is not None
    check_labels(y, classes, "target")
    x_tr, y_tr, x_te, y_te = split(x, y, test_fraction, seed)
    return Dataset(
        name=loaded.name,
        kind="table",
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        classes=classes,
        sha256=loaded.fingerprint,
        preset="table",
        feature_names=list(loaded.encoder.feature_names),
        notes=loaded.notes,
        encoder=loaded.encoder,
    )
