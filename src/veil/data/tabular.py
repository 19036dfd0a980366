"""The user's own data: ``csv:PATH``, ``parquet:PATH`` and ``npz:PATH``.

Every feature must be a finite number: a NaN, an infinity or a text cell is refused with its row and
column, never imputed or dropped (imputing from other rows would be an unaccounted statistic of the
private data; dropping rows silently changes what the guarantee covers). Labels may be numbers or
text; they are mapped to classes 0..K-1 in the order of the declared public label set (``--classes``),
which is required: veil never reads the label set off the private rows.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import numpy as np

from veil.accounting.ledger import file_sha256
from veil.data import Dataset, check_labels, drop_unlabelled, encode_labels, split
from veil.errors import DataError

__all__ = [
    "data_file",
    "load_user",
    "read_csv_columns",
    "read_parquet_columns",
    "require_target",
]


def data_file(path: str) -> Path:
    """``path`` as an existing file, or a :class:`DataError` (shared by every file reader)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            "dataset file", str(p), "the file does not exist", "check the path after csv:, parquet: or npz:"
        )
    return p


def require_target(target: str | None, scheme: str, columns: list[str]) -> str:
    """The label column ``target``, refused when not given or not among ``columns``."""
    if target is None:
        raise DataError(
            "target",
            None,
            f"a {scheme} file holds features and labels side by side; which column is the label must be said",
            f"pass --target with one of: {', '.join(columns[:20])}",
        )
    if target not in columns:
        close = difflib.get_close_matches(target, columns, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise DataError(
            "target",
            target,
            "there is no such column in the data",
            f"{hint}pass --target with one of: {', '.join(columns[:20])}",
        )
    return target


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _feature_matrix(columns: dict[str, list[Any]], names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The features as float64, and which rows hold a cell that is not a finite number (missing, text,
    NaN or infinity, or beyond float32's range, the type training reads: 1e39 is inf once cast):
    without a schema there is no missing encoding, so such a row is dropped (a per-record rule,
    counted; never a refusal on a value once rows are read)."""
    n = len(next(iter(columns.values()))) if columns else 0
    x = np.zeros((n, len(names)), dtype=np.float64)
    bad = np.zeros(n, dtype=bool)
    for j, name in enumerate(names):
        for i, cell in enumerate(columns[name]):
            value = _number(cell)
            if value is None or not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                bad[i] = True
            else:
                x[i, j] = value
    return x, bad


def _number(cell: Any) -> float | None:
    if cell is None:
        return None
    if isinstance(cell, (bool, int, float, np.integer, np.floating)):
        return float(cell)
    try:
        return float(str(cell).strip())
    except ValueError:
        return None


def _from_columns(
    name: str,
    digest: str,
    columns: dict[str, list[Any]],
    target: str,
    test_fraction: float,
    seed: int,
    first_row: int,
    declared: list[str] | None,
) -> Dataset:
    """The no-schema table: every other column a numeric feature, the target's labels in the declared
    order, the keyed train/test split.

    Guarantee. After the rows are read nothing is refused on a count: a row with a cell that is not
    a finite number, or with an undeclared label, is dropped (a per-record rule, listed in ``rules``),
    and a file with no data rows, or with none left, goes on as a table of zero rows through the same
    path. Whether that may train is the job's rule on its public N (``veil train``: N = 0 refused by
    :func:`veil.pipeline.data.check_delta`, naming N = 0 only; ``veil tune`` plans on the public
    ⌊(1 − F)·N⌋). No message here prints a count. The refusals left are on the header (column
    names: metadata, checked before reading by :func:`veil.data.check_names`) and the declared
    label set."""
    features = [c for c in columns if c != target]
    if not features:
        raise DataError(
            "dataset", name, "there are no feature columns besides the target", "add feature columns"
        )
    x, bad = _feature_matrix(columns, features)
    y, classes = encode_labels(columns[target], f"target '{target}'", declared)
    keep, rules = drop_unlabelled(y, bad)
    x, y = x[keep], y[keep]
    check_labels(y, classes, f"target '{target}'")
    x_tr, y_tr, x_te, y_te = split(x.astype(np.float32), y, test_fraction, seed, classes)
    return Dataset(
        name=name,
        kind="table",
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        classes=classes,
        sha256=digest,
        preset="table",
        feature_names=features,
        classes_declared_by="--classes (public by declaration)",
        rules=rules,
    )


def read_csv_columns(
    p: Path, encoding: str = "utf-8", multiline_values: bool = False
) -> dict[str, list[Any]]:
    """A CSV as ``{column: [cells as str]}`` (header row required, every row as wide), read by the
    tables' pyarrow reader (:func:`veil.tables.sources.read_csv_text`): one CSV parser for every job,
    so U+0085 or U+2028 inside a cell never cuts a row. One physical line is one record unless
    ``multiline_values`` (declared: quoted values may span lines; see
    :mod:`veil.tables.sources.csv_reader` for the risk). ``encoding`` is declared. A header-only file
    gives empty columns (no refusal on the row count: :func:`_from_columns`); no header is refused."""
    from veil.tables.sources import parse_source, read_csv_text

    columns = read_csv_text(parse_source(f"csv:{p}", encoding=encoding, multiline_values=multiline_values))
    if not columns:  # the header is metadata, read before any row (veil.data.check_names)
        raise DataError("dataset file", str(p), "a CSV needs a header row", "add one")
    return dict(columns)


def read_parquet_columns(p: Path) -> dict[str, list[Any]]:
    """A Parquet file as ``{column: [values]}`` (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise DataError(
            "dataset",
            f"parquet:{p}",
            "reading Parquet needs the optional pyarrow package",
            "pip install pyarrow (or use csv:/npz:)",
        ) from None
    try:
        table = pq.read_table(p)
    except Exception as exc:
        raise DataError(
            "dataset file", str(p), f"it is not a readable Parquet file ({exc})", "check the file"
        ) from None
    return {str(k): list(v) for k, v in table.to_pydict().items()}


def _load_npz(
    p: Path, target: str | None, test_fraction: float, seed: int, declared: list[str] | None
) -> Dataset:
    try:
        with np.load(p, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except ValueError as exc:
        raise DataError(
            "dataset file",
            str(p),
            f"it is not a plain numeric .npz file ({exc})",
            "save arrays with np.savez",
        ) from None
    except Exception as exc:
        raise DataError(
            "dataset file", str(p), f"it cannot be read as .npz ({exc})", "save arrays with np.savez"
        ) from None
    label_key = require_target(target or ("y" if "y" in arrays else None), "npz", list(arrays))
    others = [k for k in arrays if k != label_key]
    feature_key = next(
        (k for k in ("x", "X", "features", "data") if k in others), others[0] if len(others) == 1 else None
    )
    if feature_key is None:
        raise DataError(
            "npz arrays",
            ", ".join(arrays),
            "the features array cannot be told apart",
            "name the features array 'x'",
        )
    x, labels = arrays[feature_key], arrays[label_key]
    if x.ndim < 2 or labels.ndim != 1 or len(x) != len(labels):
        raise DataError(
            "npz arrays",
            f"{feature_key}{x.shape}, {label_key}{labels.shape}",
            "features must be N×... with one label per example",
            "save x with shape (N, features) or (N, [C,] H, W) and y with shape (N,)",
        )
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise DataError(
            f"npz array '{feature_key}'", str(x.dtype), "features must be real numbers", "convert them"
        )
    # Finite as float32, the type training reads (1e300 is a finite float64 and inf once cast).
    finite = (
        np.isfinite(x.reshape(len(x), math.prod(x.shape[1:])).astype(np.float32)).all(axis=1)
        if np.issubdtype(x.dtype, np.floating)
        else None
    )
    y, classes = encode_labels(labels, f"npz array '{label_key}'", declared)
    keep, rules = drop_unlabelled(y, None if finite is None else ~finite)
    x, y = x[keep], y[keep]
    check_labels(y, classes, f"npz array '{label_key}'")
    image = x.ndim >= 3
    pixel_max = 255.0 if image and x.dtype == np.uint8 else None
    if x.ndim == 3:
        x = x[:, None]
    x_tr, y_tr, x_te, y_te = split(x.astype(np.float32), y, test_fraction, seed, classes)
    return Dataset(
        name=f"npz:{p}",
        kind="image" if image else "table",
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        classes=classes,
        sha256=file_sha256(p),
        preset=("image" if x.shape[-1] >= 16 else "image-small") if image else "table",
        feature_names=None if image else [f"{feature_key}[{j}]" for j in range(x.shape[1])],
        pixel_max=pixel_max,
        classes_declared_by="--classes (public by declaration)",
        notes=[] if pixel_max or not image else ["image values are used as given (not rescaled)"],
        rules=rules,
    )


def load_user(
    scheme: str,
    path: str,
    *,
    target: str | None,
    test_fraction: float,
    seed: int,
    classes: list[str] | None = None,
) -> Dataset:
    """Load ``scheme:path`` (csv, parquet or npz) with labels from ``target``, in the order of the
    declared public label set ``classes`` (required)."""
    p = data_file(path)
    if scheme == "npz":
        return _load_npz(p, target, test_fraction, seed, classes)
    columns = read_csv_columns(p) if scheme == "csv" else read_parquet_columns(p)
    label = require_target(target, scheme, list(columns))
    return _from_columns(
        f"{scheme}:{p}",
        file_sha256(p),
        columns,
        label,
        test_fraction,
        seed,
        first_row=2 if scheme == "csv" else 1,
        declared=classes,
    )
