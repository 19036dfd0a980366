"""IDX files (the MNIST format), gzipped or not, and the ``fashion-mnist``/``mnist`` datasets.

IDX layout: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions, then each
dimension as a big-endian 32-bit integer, then the data in C order.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np

from veil.data import BUILTIN_PRESETS, Dataset, check_labels
from veil.data.rows import flat_rows
from veil.errors import DataError

__all__ = ["IDX_FILES", "load_idx_dataset", "read_idx"]

_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
IDX_FILES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}
CLASSES = {
    "fashion-mnist": [
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ],
    "mnist": [str(i) for i in range(10)],
}


def _bad(path: Path, why: str) -> DataError:
    return DataError("IDX file", str(path), why, "replace it with an intact IDX file (gzipped or not)")


def read_idx(path: Path) -> tuple[np.ndarray, bytes]:
    """The array in an IDX file and the file's raw bytes (as stored, for the fingerprint)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(
            "IDX file", str(path), f"it cannot be read ({exc.strerror})", "check the path and permissions"
        ) from None
    data = raw
    if raw[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise _bad(path, f"it is not a valid gzip file ({exc})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise _bad(path, "it does not start with an IDX header")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim < 1 or len(data) < header:
        raise _bad(path, "its IDX header is truncated")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_DTYPES[data[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) - header != expected:
        raise _bad(path, f"it holds {len(data) - header} data bytes where its header announces {expected}")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return array, raw


def _find(folder: Path, key: str) -> Path:
    for stem in IDX_FILES[key]:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    names = ", ".join(f"{s}[.gz]" for s in IDX_FILES[key][:1])
    raise DataError(
        "data_dir",
        str(folder),
        f"the IDX file {names} is missing",
        "pass --data-dir with the folder of the four IDX files (for "
        "fashion-mnist: apt-get install dataset-fashion-mnist)",
    )


def _declared(labels: np.ndarray, k: int) -> np.ndarray:
    """Which labels name one of the ``k`` documented classes: a whole number in ``0 .. k-1``, judged on
    each label alone (an IDX file may store labels as signed or real numbers)."""
    values = labels.astype(np.float64)
    return np.isfinite(values) & (values >= 0) & (values < k) & (values == np.floor(values))


def _pixels_in_range(images: np.ndarray) -> np.ndarray:
    """Which images have every pixel a number in ``0 .. 255`` (the IDX benchmarks' documented range;
    an IDX file may store reals). A NaN pixel made its example's clip factor NaN and every noisy sum
    with it, and a huge one (1e300, inf once cast to float32; 3e38 overflowing the forward) did the
    same through the weights: one record decided the released model. Such an image is dropped."""
    if images.dtype == np.uint8:
        return np.ones(len(images), dtype=bool)
    flat = flat_rows(images)
    ok = np.ones(len(images), dtype=bool)
    for start in range(0, len(flat), 4096):
        part = flat[start : start + 4096].astype(np.float64)
        ok[start : start + 4096] = (np.isfinite(part) & (part >= 0) & (part <= 255)).all(axis=1)
    return ok


def load_idx_dataset(name: str, data_dir: str) -> Dataset:
    """The official train/test split of ``name`` from ``data_dir``, images as 1×H×W, pixels 0..255."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise DataError(
            "data_dir",
            str(folder),
            f"the folder with the {name} IDX files does not exist",
            "pass --data-dir with the folder of the four IDX files"
            + (" (or apt-get install dataset-fashion-mnist)" if name == "fashion-mnist" else ""),
        )
    arrays: dict[str, np.ndarray] = {}
    digest = hashlib.sha256()
    for key in ("train_images", "train_labels", "test_images", "test_labels"):
        path = _find(folder, key)
        arrays[key], raw = read_idx(path)
        digest.update(hashlib.sha256(raw).digest())
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"{part} IDX files",
                f"images {images.shape}, labels {labels.shape}",
                "images must be N×H×W with one label per image",
                "use matching image and label files",
            )
    classes = CLASSES[name]
    # A label outside the benchmark's documented classes drops its image (a per-record rule, counted
    # in `rules`), never a refusal: after the first row is read nothing may depend on one record.
    keep = {part: _declared(arrays[f"{part}_labels"], len(classes)) for part in ("train", "test")}
    finite = {part: _pixels_in_range(arrays[f"{part}_images"]) for part in ("train", "test")}
    rules = {
        "rows_dropped_label_not_declared": int((~keep["train"]).sum()),
        "rows_dropped_pixel_not_in_0_255": int((keep["train"] & ~finite["train"]).sum()),
    }
    keep = {part: keep[part] & finite[part] for part in keep}
    y_train = arrays["train_labels"].astype(np.int64)[keep["train"]]
    y_test = arrays["test_labels"].astype(np.int64)[keep["test"]]
    check_labels(y_train, list(classes), "train labels")
    return Dataset(
        name=name,
        kind="image",
        x_train=arrays["train_images"][keep["train"]][:, None].astype(np.float32),
        y_train=y_train,
        x_test=arrays["test_images"][keep["test"]][:, None].astype(np.float32),
        y_test=y_test,
        classes=list(classes),
        sha256=digest.hexdigest(),
        preset=BUILTIN_PRESETS[name],
        pixel_max=255.0,
        rules=rules,
    )
