"""The user's own data: ``csv:PATH``, ``parquet:PATH`` and ``npz:PATH``.

Every feature must be a finite number: a NaN, an infinity or a text cell is refused with its row and
column, never imputed or dropped (imputing from other rows would be an unaccounted statistic of the
private data; dropping rows silently changes what the guarantee covers). Labels may be numbers or
text; they are mapped to classes 0..K-1 in the order of the declared public label set (``--classes``),
which is required: veil never reads the label set off the private rows.
"""

from __future__ import annotations

import csv
import difflib
import math
from pathlib import Path
from typing import Any

import numpy as np

from veil.accounting.ledger import file_sha256
from veil.data import Dataset, check_labels, encode_labels, split
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


def _feature_matrix(columns: dict[str, list[Any]], names: list[str], first_row: int) -> np.ndarray:
    n = len(next(iter(columns.values()))) if columns else 0
    x = np.empty((n, len(names)), dtype=np.float64)
    for j, name in enumerate(names):
        for i, cell in enumerate(columns[name]):
            value: float
            if isinstance(cell, bool) or cell is None:
                value = math.nan if cell is None else float(cell)
                if cell is None:
                    _bad_cell(i + first_row, name, cell, "is missing")
            elif isinstance(cell, (int, float, np.integer, np.floating)):
                value = float(cell)
            else:
                text = str(cell).strip()
                try:
                    value = float(text)
                except ValueError:
                    _bad_cell(i + first_row, name, cell, "is not a number" if text else "is empty")
            if not math.isfinite(value):
                _bad_cell(i + first_row, name, cell, "is not finite (NaN or infinity)")
            x[i, j] = value
    return x


def _bad_cell(row: int, column: str, cell: Any, what: str) -> None:
    raise DataError(
        f"row {row} column '{column}'",
        cell,
        f"the feature {what}; veil does not impute or drop "
        "rows, since either would use or change the private "
        "data without accounting",
        "a table with text or missing cells needs a schema: draft one with `veil schema infer FILE "
        "--target COLUMN --out schema.toml` (or release one with --epsilon), then train with --schema "
        "schema.toml (docs/tables.md); else clean the file so that every feature is a finite number",
    )


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
    features = [c for c in columns if c != target]
    if not features:
        raise DataError(
            "dataset", name, "there are no feature columns besides the target", "add feature columns"
        )
    if not columns[target]:
        raise DataError("dataset", name, "the file has no data rows", "provide a file with examples")
    x = _feature_matrix(columns, features, first_row)
    y, classes = encode_labels(columns[target], f"target '{target}'", declared)
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
    )


def read_csv_columns(p: Path) -> dict[str, list[Any]]:
    """A UTF-8 CSV as ``{column: [cells as str]}`` (header row required, every row as wide)."""
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            "dataset file", str(p), f"it cannot be read as UTF-8 text ({exc})", "save it as UTF-8 CSV"
        ) from None
    try:
        dialect: Any = csv.Sniffer().sniff(text[:4096], delimiters=",;\t")
    except csv.Error:
        dialect = csv.excel
    rows = [r for r in csv.reader(text.splitlines(), dialect) if r]
    if len(rows) < 2:
        raise DataError(
            "dataset file", str(p), "a CSV needs a header row and at least one data row", "add them"
        )
    header = [h.strip() for h in rows[0]]
    if len(set(header)) != len(header):
        raise DataError(
            "CSV header", str(p), "column names must be unique to name the target", "rename duplicates"
        )
    for i, r in enumerate(rows[1:], start=2):
        if len(r) != len(header):
            raise DataError(
                f"CSV row {i}",
                f"{len(r)} cells",
                f"the header has {len(header)} columns",
                "make every row as wide as the header",
            )
    return {h: [r[j] for r in rows[1:]] for j, h in enumerate(header)}


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
    bad = ~np.isfinite(x.reshape(len(x), -1)) if np.issubdtype(x.dtype, np.floating) else None
    if bad is not None and bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        _bad_cell(
            row,
            f"{feature_key}[{col}]",
            float(x.reshape(len(x), -1)[row, col]),
            "is not finite (NaN or infinity)",
        )
    y, classes = encode_labels(labels, f"npz array '{label_key}'", declared)
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
