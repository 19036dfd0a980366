"""A text classification dataset for ``veil train --model hf:DIR --text-column COL``.

Reads a CSV (UTF-8) or Parquet file, or a SQL table or query (through the tables' SQLAlchemy
reader, :mod:`veil.tables.sources`), reads the text column row by row
(:func:`veil.text.tokens.text_rows`) and the labels, tokenizes every text with the model folder's
own tokenizer (public) to the declared ``max_length``, and splits by the run's seed. Like the other
readers, nothing here computes a statistic of the data: token ids are a fixed per-example map, so
the arrays are as private as the texts and no more.
"""

from __future__ import annotations

from typing import Any

from veil.data import Dataset, check_labels, drop_unlabelled, encode_labels, sha256_arrays, split
from veil.errors import ConfigError, DataError

__all__ = ["TEXT_SCHEMES", "load_text_dataset", "model_folder"]

TEXT_SCHEMES = ("csv", "parquet", "sql")


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


def check_model_folder(model: str, fine_tune: str | None, device: str, max_length: int) -> Any:
    """The model folder's checks, all on public files: weights and tokenizer present, the model fits
    the device's memory for ``fine_tune``, ``max_length`` within what it reads. ``veil train`` runs
    them before the run is charged; returns the inspected folder."""
    from veil.text.load import check_fits, inspect_folder, load_tokenizer
    from veil.text.tokens import check_max_length

    folder = inspect_folder(model_folder(model))
    if fine_tune in ("head", "lora", "full"):
        check_fits(folder, fine_tune, device)  # type: ignore[arg-type]
    check_max_length(load_tokenizer(folder), max_length)
    return folder


def _sql_columns(dataset: str, table: str | None, query: str | None) -> tuple[str, str, dict[str, Any]]:
    """A ``sql:URL`` table or query read through the tables' SQL reader (SQLAlchemy): its printable
    name, its fingerprint (the address and table/query, as for other SQL data) and its columns
    (numeric columns as numpy arrays, so a numeric text column is named as such)."""
    from veil.tables.dataset import source_fingerprint
    from veil.tables.sources import parse_source, read_source, refuse_password_in_url

    refuse_password_in_url(dataset[4:])
    source = parse_source(dataset, table=table, query=query)
    raw = read_source(source, None).table
    columns: dict[str, Any] = {}
    for name in raw.column_names:
        column = raw.column(name)
        numeric = str(column.type).startswith(("int", "uint", "float", "double", "decimal"))
        columns[name] = column.to_numpy(zero_copy_only=False) if numeric else column.to_pylist()
    return source.describe(), source_fingerprint(dataset, table, query), columns


def _read_columns(
    dataset: str, table: str | None, query: str | None, multiline_values: bool = False
) -> tuple[str, str | None, dict[str, Any]]:
    """The printable name, fingerprint and columns of ``csv:PATH``, ``parquet:PATH`` or ``sql:URL``
    (``table``/``query`` only for SQL; ``multiline_values``: a CSV's quoted values may span lines)."""
    from veil.accounting.ledger import file_sha256
    from veil.data.tabular import data_file, read_csv_columns, read_parquet_columns

    scheme, _, path = dataset.partition(":")
    if scheme == "sql":
        return _sql_columns(dataset, table, query)
    if table is not None or query is not None:
        raise DataError(
            "--table/--query", table or query, "only a sql: source has tables", "drop it, or use sql:URL"
        )
    p = data_file(path)
    columns = (
        read_csv_columns(p, multiline_values=multiline_values) if scheme == "csv" else read_parquet_columns(p)
    )
    return f"{scheme}:{p}", file_sha256(p), columns


def _check_text_column(text_column: str, label: str, columns: list[str]) -> None:
    """The text column exists and is not the label column (names only: no value is read)."""
    if text_column not in columns:
        raise DataError(
            "text_column",
            text_column,
            "there is no such column in the data",
            f"pass --text-column with one of: {', '.join(columns[:20])}",
        )
    if text_column == label:
        raise DataError(
            "text_column", text_column, "it is also the target column", "name the text and label columns"
        )


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
    table: str | None = None,
    query: str | None = None,
    fine_tune: str | None = None,
    device: str = "cpu",
    multiline_values: bool = False,
) -> Dataset:
    """Tokenized texts ``[N, 2, max_length]`` (int64) and labels from ``csv:PATH``, ``parquet:PATH``
    or ``sql:URL`` (with ``table`` or ``query``). With ``fine_tune``, a model too large to fine-tune
    that way on ``device`` is refused before the data is read."""
    from veil.data.tabular import require_target
    from veil.text.load import load_tokenizer
    from veil.text.tokens import TEXT_RULES, text_rows, tokenize

    scheme, _, path = dataset.partition(":")
    if scheme not in TEXT_SCHEMES or not path:
        raise ConfigError(
            "dataset",
            dataset,
            "a text column is read from a CSV or Parquet file or a SQL table",
            "pass --dataset csv:PATH, parquet:PATH or sql:URL (with --table or --query)",
        )
    folder = check_model_folder(model, fine_tune, device, max_length)  # before reading the data
    name, digest, columns = _read_columns(dataset, table, query, multiline_values)
    label = require_target(target, scheme, list(columns))
    _check_text_column(text_column, label, list(columns))
    texts, reason = text_rows(columns[text_column], text_column)  # a missing or blank text drops the row
    y, classes = encode_labels(columns[label], f"column {label}", classes)
    keep, rules = drop_unlabelled(y)  # an undeclared or missing label drops the row (docs/tables.md)
    for code, rule in enumerate(TEXT_RULES, start=1):
        rules[rule] = int(((reason == code) & keep).sum())
    keep &= reason == 0
    y, texts = y[keep], [t for t, k in zip(texts, keep, strict=True) if k]
    check_labels(y, classes, f"column {label}")
    x = tokenize(load_tokenizer(folder), texts, max_length)
    x_train, y_train, x_test, y_test = split(x, y, test_fraction, seed)
    return Dataset(
        name=name,
        kind="text",  # type: ignore[arg-type]
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        classes=classes,
        sha256=digest or sha256_arrays(x, y),
        preset=preset,
        feature_names=[text_column],
        notes=[f"texts of column '{text_column}' tokenized by the model's tokenizer to {max_length} tokens"],
        classes_declared_by="--classes (public by declaration)",
        rules=rules,
    )
