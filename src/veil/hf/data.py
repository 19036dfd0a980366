"""A text classification dataset for ``veil train --model hf:DIR --text-column COL``.

Reads a CSV (UTF-8) or Parquet file, checks the text column (:func:`veil.hf.text.check_texts`) and
the labels, tokenizes every text with the model folder's own tokenizer (public) to the declared
``max_length``, and splits by the run's seed. Like the other readers, nothing here computes a
statistic of the data: token ids are a fixed per-example map, so the arrays are as private as the
texts and no more.
"""

from __future__ import annotations

from veil.data import Dataset, check_labels, encode_labels, sha256_arrays, split
from veil.errors import ConfigError, DataError

__all__ = ["TEXT_SCHEMES", "load_text_dataset", "model_folder"]

TEXT_SCHEMES = ("csv", "parquet")


def model_folder(model: str) -> str:
    """The folder of ``hf:DIR``, or a :class:`ConfigError` for another model name."""
    if not model.startswith("hf:") or not model[3:]:
        raise ConfigError(
            "model",
            model,
            "text is read through a pretrained model's tokenizer and encoder",
            "pass --model hf:DIR with a folder saved by save_pretrained",
        )
    return model[3:]


def load_text_dataset(
    dataset: str,
    *,
    model: str,
    text_column: str,
    target: str | None,
    max_length: int,
    test_fraction: float,
    seed: int,
    preset: str,
    classes: list[str] | None = None,
) -> Dataset:
    """Tokenized texts ``[N, 2, max_length]`` (int64) and labels from ``csv:PATH``/``parquet:PATH``."""
    from veil.data.tabular import _file, _read_csv, _read_parquet, _require_target, _sha256
    from veil.hf.load import inspect_folder, load_tokenizer
    from veil.hf.text import check_texts, tokenize

    scheme, _, path = dataset.partition(":")
    if scheme not in TEXT_SCHEMES or not path:
        raise ConfigError(
            "dataset",
            dataset,
            "a text column is read from a CSV or Parquet file",
            "pass --dataset csv:PATH or parquet:PATH",
        )
    folder = inspect_folder(model_folder(model))  # before reading the data: a bad folder fails fast
    p = _file(path)
    columns = _read_csv(p) if scheme == "csv" else _read_parquet(p)
    label = _require_target(target, scheme, list(columns))
    if text_column not in columns:
        raise DataError(
            "text_column",
            text_column,
            "there is no such column in the data",
            f"pass --text-column with one of: {', '.join(list(columns)[:20])}",
        )
    if text_column == label:
        raise DataError(
            "text_column", text_column, "it is also the target column", "name the text and label columns"
        )
    texts = check_texts(columns[text_column], text_column)
    y, classes = encode_labels(columns[label], f"column {label}", classes)
    check_labels(y, classes, f"column {label}")
    x = tokenize(load_tokenizer(folder), texts, max_length)
    x_train, y_train, x_test, y_test = split(x, y, test_fraction, seed)
    return Dataset(
        name=f"{scheme}:{p}",
        kind="text",  # type: ignore[arg-type]
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        classes=classes,
        sha256=_sha256(p) if p.is_file() else sha256_arrays(x, y),
        preset=preset,
        feature_names=[text_column],
        notes=[f"texts of column '{text_column}' tokenized by the model's tokenizer to {max_length} tokens"],
        classes_declared_by="--classes (public by declaration)",
    )
