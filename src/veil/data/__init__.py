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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from veil.data.rows import flat_rows
from veil.errors import ConfigError, DataError

if TYPE_CHECKING:
    from veil.tables.schema import TableSchema

__all__ = [
    "BUILTIN",
    "BUILTIN_PRESETS",
    "BUILTIN_SHAPES",
    "DEFAULT_DATA_DIRS",
    "SCHEMA_CLASSES_FIX",
    "Dataset",
    "check_labels",
    "check_names",
    "check_request",
    "check_sql_request",
    "drop_unlabelled",
    "encode_labels",
    "load_dataset",
    "split",
]

BUILTIN = ("digits", "breast-cancer", "fashion-mnist", "mnist")
BUILTIN_SHAPES: dict[str, tuple[str, tuple[int, ...]]] = {
    "digits": ("image", (1, 8, 8)),
    "breast-cancer": ("table", (30,)),
    "fashion-mnist": ("image", (1, 28, 28)),
    "mnist": ("image", (1, 28, 28)),
}
"""Each built-in dataset's kind and example shape, from its documentation: public, so the checks
that depend on them run before a row is read."""
BUILTIN_PRESETS: dict[str, str] = {
    "digits": "image-small",
    "breast-cancer": "table",
    "fashion-mnist": "image",
    "mnist": "image",
}
"""Each built-in dataset's preset family (:mod:`veil.presets`), fixed by its name: public, so the
plan's public parts (the scattering preset's whitening release) are known before a row is read."""
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
    classes_declared_by: str = "the dataset's documentation (built in)"
    """Where the public label set comes from (never from the private rows)."""
    rules: dict[str, int] = field(default_factory=dict)
    """How many rows or cells the schema's per-record rules touched (dropped rows, cells made missing):
    non-private counts, reported in ``non_private``."""
    units_train: np.ndarray | None = None
    """Privacy units (``--privacy-unit``): each training row's unit as a keyed hash of its id
    (:func:`unit_hashes`; the ids themselves are not kept). None: each row is its own unit."""
    unit_column: str | None = None
    """The column the units were read from (a name from the configuration, safe to print)."""

    @property
    def n_units(self) -> int | None:
        """Distinct units among the training rows (public by declaration, like N), or None."""
        return None if self.units_train is None else len(np.unique(self.units_train))

    @property
    def n_records(self) -> int:
        """What the guarantee counts: units with a privacy unit, else training rows."""
        units = self.n_units
        return self.n_train if units is None else units

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


NO_LABEL = -2
"""The class index :func:`encode_labels` gives a row without a label (dropped by :func:`drop_unlabelled`)."""
UNDECLARED = -1
"""The class index :func:`encode_labels` gives a label outside the declared set (dropped too)."""


def encode_labels(
    raw: list[Any] | np.ndarray, where: str, declared: list[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """Class indices 0..K-1 in the order of the ``declared`` public label set; :data:`UNDECLARED` for a
    label outside it and :data:`NO_LABEL` for a missing one (the caller drops those rows with
    :func:`drop_unlabelled`: a per-record public rule, never a refusal on a value once rows are read).

    The label set is public by declaration: it fixes the model's output width, so reading it off the
    private rows would reveal a row whose label is unique. Without a declaration the data is refused."""
    if declared is None:
        raise undeclared_classes()
    index = {c: i for i, c in enumerate(declared)}
    missing = ("", "nan", "none", "null")
    codes = []
    for v in np.asarray(raw, dtype=object).ravel():
        text = _label_text(v)
        if text not in index and isinstance(v, (float, np.floating)):
            text = str(v).strip()  # a class declared as "1.0" still matches the real 1.0
        codes.append(index.get(text, NO_LABEL if text.lower() in missing else UNDECLARED))
    return np.array(codes, dtype=np.int64), list(declared)


CLASSES_FIX = "declare the public label set in class order: --classes a,b,c (config key classes)"
#: The fix for a job without ``--classes`` (``veil tune``, ``veil federated``): the schema declares them.
SCHEMA_CLASSES_FIX = (
    "read the table through a reviewed schema (--schema) whose target column declares its classes"
)


def undeclared_classes(fix: str = CLASSES_FIX) -> ConfigError:
    """The one refusal of user data without a declared label set."""
    return ConfigError(
        "classes",
        None,
        "the label set sets the model's output width; read off the private rows it would reveal a "
        "row whose label is unique, so veil never takes it from the data",
        fix,
    )


def _label_text(value: Any) -> str:
    """A label cell's text by a rule on the cell alone: an integer (or a real that is one: a column of
    integers read as reals because another row is missing) as its digits, a missing cell as ``""``."""
    from veil.tables.sources.cells import number_text

    if value is None:
        return ""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return number_text(float(value)) or ""
    return str(value).strip()


def drop_unlabelled(y: np.ndarray, bad_rows: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """Which rows to keep (a label in the declared set and, if given, not ``bad_rows``), and the counts
    of what the per-record rules dropped (non-private)."""
    keep = np.asarray(y) >= 0
    rules = {
        "rows_dropped_label_not_declared": int((np.asarray(y) == UNDECLARED).sum()),
        "rows_dropped_label_missing": int((np.asarray(y) == NO_LABEL).sum()),
    }
    if bad_rows is not None:
        rules["rows_dropped_feature_not_a_finite_number"] = int((bad_rows & keep).sum())
        keep &= ~bad_rows
    return keep, rules


def check_labels(y: np.ndarray, classes: list[str], where: str, *, count_rows: bool = True) -> None:
    """Refuse a label set of fewer than two classes (the declared set: public, whatever the rows).

    The number of examples is never checked here: it is read from the private rows, and a refusal on
    it (or a message printing it) would depend on one record, for a job whose N is private (PATE) as
    much as for the total N + n_test of any job. Too few examples to train on is N = 0 on the training
    side, refused where N is public (:func:`veil.pipeline.data.check_delta`). ``count_rows`` is kept
    for the callers' signature; nothing is counted."""
    del y, count_rows
    if len(classes) < 2:
        raise DataError(
            where,
            f"1 class ({classes[0] if classes else 'none'})",
            "a classifier needs at least two classes to learn anything",
            "check the target column, or add examples of the other classes",
        )


def held_out(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, classes: list[str] | None = None
) -> np.ndarray:
    """Which rows are held out: row ``i`` is when a keyed hash of its own content (features and
    label name, ``classes[y[i]]``, or the index without names; key from ``seed``) falls below
    ``test_fraction``.

    Guarantee. A row's side depends on that row alone, never on its position or on the other rows:
    adding or removing one row leaves every other row on its side, so neighbouring datasets keep
    neighbouring training splits (add/remove-one). Equal rows land on the same side."""
    labels = [str(classes[int(v)]) if classes is not None else str(int(v)) for v in np.asarray(y)]
    cut = test_fraction * 2.0**64
    return np.array([h < cut for h in row_hashes(x, labels, "veil.split", seed)], dtype=bool)


def row_hashes(x: np.ndarray, labels: list[str], domain: str, seed: int) -> list[int]:
    """A 64-bit keyed BLAKE2b hash of each row's own features and label (key from ``domain`` and
    ``seed``): a function of the row alone, never of its index or of the other rows (``-0.0`` and
    ``0.0`` hash alike; equal rows share it). Python ints, so comparisons with a float are exact."""
    key = hashlib.blake2b(f"{domain}/{int(seed)}".encode(), digest_size=32).digest()
    out = []
    for start in range(0, len(x), _HASH_CHUNK):  # float64 copies of a chunk only, never of all rows
        chunk = np.asarray(x[start : start + _HASH_CHUNK], dtype=np.float64)
        rows = np.ascontiguousarray(flat_rows(chunk) + 0.0)
        for i in range(len(rows)):
            h = hashlib.blake2b(rows[i].tobytes(), digest_size=8, key=key)
            h.update(b"|" + labels[start + i].encode())
            out.append(int.from_bytes(h.digest(), "little"))
    return out


_HASH_CHUNK = 4096
"""Rows converted to float64 at once by :func:`row_hashes` (the hashes do not depend on it)."""


def unit_hashes(ids: list[object], seed: int) -> np.ndarray:
    """A 64-bit keyed hash of each unit id (:func:`row_hashes` of the id alone, domain ``veil.unit``).

    A function of the id alone, so every row of a person gets the same key: the key both groups a
    person's rows and decides their side of the split. ``uint64``."""
    texts = [str(v) for v in ids]
    return np.array(row_hashes(np.zeros((len(texts), 0)), texts, "veil.unit", seed), dtype=np.uint64)


def unit_sides(
    ids: list[object], test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(known, keys, test)``: which rows have a unit id (a missing one, ``None``, is in no split),
    the keyed hash of each known row's id and whether it is held out (its key below
    ``test_fraction``·2⁶⁴). A function of each row's id alone: the one rule of the in-memory split
    (:func:`split_by_unit`) and of a streamed scan (:func:`veil.tables.stream.scan_parquet`)."""
    known = np.array([v is not None for v in ids], dtype=bool)
    keys = unit_hashes([v for v in ids if v is not None], seed)
    return known, keys, keys < np.uint64(min(int(test_fraction * 2.0**64), 2**64 - 1))


def split_by_unit(
    x: np.ndarray, y: np.ndarray, ids: list[object], test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A train/test split by unit: ``(x_train, y_train, x_test, y_test, units_train)``.

    Guarantee. A row's side is a function of its unit id alone (a keyed hash below
    ``test_fraction``), so every row of a person lands on the same side, and adding or removing one
    person (all their rows) leaves every other person's rows where they were. A row with a missing
    id (``None``) belongs to no unit and is dropped (a per-record rule, never a refusal). Either side
    may be empty, as in :func:`split`: never a refusal after reading."""
    known, keys, test = unit_sides(ids, test_fraction, seed)
    x, y = x[known], y[known]
    return x[~test], y[~test], x[test], y[test], keys[~test]


def split(
    x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, classes: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A train/test split by :func:`held_out` (each row by a keyed hash of its content; key from ``seed``).

    About ``test_fraction`` of the rows are held out (the count varies like a binomial). The test
    metrics computed on them are a non-private release about those rows.

    Either side may be empty, and neither is refused here: whether it is depends on one record (a
    held-out row leaves the public N unchanged), so a refusal would let that record decide whether a
    model is released. An empty test side trains as usual and reports no test metric (absent, in
    ``non_private``); an empty training side is N = 0, which each job handles from N alone (public
    for ``veil train``: :func:`veil.pipeline.data.check_delta`)."""
    test = held_out(x, y, test_fraction, seed, classes)
    return x[~test], y[~test], x[test], y[test]


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
    classes: list[str] | None = None,
    privacy_unit: str | None = None,
) -> Dataset:
    """Load, check and split the dataset called ``name`` (see the module docstring).

    ``classes``: the public label set (required for the user's own data unless a reviewed ``schema``
    declares it; a built-in dataset or a schema declares its own, and a different declaration is
    refused). ``privacy_unit``: a column of a table read through its schema, grouping rows by person
    (refused before reading for any other data); the split is then by unit (:func:`split_by_unit`)."""
    check_request(name, schema=schema, target=target, classes=classes, privacy_unit=privacy_unit, query=query)
    if schema is not None or name.startswith("sql:"):
        data = _load_with_schema(name, schema, target, table, query, test_fraction, seed, privacy_unit)
    else:
        data = _load(
            name, data_dir=data_dir, target=target, test_fraction=test_fraction, seed=seed, classes=classes
        )
    if (
        classes is not None
        and not data.classes_declared_by.startswith("--classes")
        and classes != data.classes
    ):
        raise ConfigError(
            "classes",
            ",".join(classes),
            f"'{name}' declares its own public label set ({', '.join(data.classes)}): "
            f"{data.classes_declared_by}",
            "drop --classes, or change the declaration where it is made",
        )
    return data


def check_request(
    name: str,
    *,
    schema: str | None = None,
    target: str | None = None,
    classes: list[str] | None = None,
    privacy_unit: str | None = None,
    classes_fix: str = CLASSES_FIX,
    query: str | None = None,
) -> None:
    """Every refusal of :func:`load_dataset` that needs no row of the data: a unit column without a
    schema, a SQL source without a schema or with a password in its URL (or a ``query`` on a database
    whose column check would run it over the rows), a schema on data that is no
    table, a schema that does not load or is not reviewed (a typo in it), a ``target`` the schema
    does not name, and the user's own file (``csv:``/``parquet:``/``npz:``) missing or without a
    declared label set. :func:`load_dataset` runs it first; a job that charges the budget runs it
    before the charge, so that such public mistakes are refused for free (``classes_fix``: the job's
    way to declare the label set). A CSV's header line and a Parquet file's or an ``.npz`` archive's
    column names (metadata, no row: public, as the loaders' messages already treat them) are checked
    here too: the ``target`` among them, and a schema's columns both ways (:func:`check_names`)."""
    if privacy_unit is not None and schema is None:
        raise ConfigError(
            "privacy_unit",
            privacy_unit,
            "the unit column must be declared an identifier (never a feature) before the table is read",
            f'read the table through a reviewed schema (--schema) that declares [columns."{privacy_unit}"] '
            'type = "ignored"',
        )
    if schema is None and not name.startswith("sql:"):
        scheme, _, path = name.partition(":") if ":" in name else ("", "", "")
        if scheme in USER_SCHEMES and path:
            from veil.data.tabular import data_file

            data_file(path)  # a missing file first: the fix is elsewhere
            if classes is None:
                raise undeclared_classes(classes_fix)
            check_names(name, target=target)
        return
    from veil.tables.sources import hide_password

    shown = "sql:" + hide_password(name[4:]) if name.startswith("sql:") else name
    if schema is None:
        raise ConfigError(
            "dataset",
            shown,
            "a SQL table's columns, levels, bounds and classes must be declared before it is read",
            "pass --schema SCHEMA.toml (draft one with `veil schema infer`, then review it)",
        )
    check_sql_request(name, query=query)
    if name.partition(":")[0] not in ("csv", "parquet", "sql"):
        raise ConfigError(
            "dataset",
            name,
            "a schema describes a table",
            "use csv:PATH, parquet:PATH or sql:URL with --schema",
        )
    from veil.tables.schema import load_schema

    loaded = load_schema(schema)
    loaded.require_reviewed(schema)
    declared = loaded.target
    if target is not None and (declared is None or declared.name != target):
        raise ConfigError(
            "target",
            target,
            f"the schema's target column is {declared.name if declared else 'not declared'}",
            "drop --target (the schema says which column is the label) or fix the schema",
        )
    check_names(name, schema=loaded, unit_column=privacy_unit)


def check_sql_request(name: str, *, query: str | None = None) -> None:
    """A ``sql:`` source's refusals that need its URL and flags alone: a password in the URL (the run
    folder records the address), and a ``query`` on a database whose column check would run it over
    the rows (:func:`veil.tables.sources.sql_reader.refuse_query_without_check`). Nothing for any
    other source.

    Guarantee: every job runs it before its account with the budget registry opens
    (:func:`veil.pipeline.private_data.open_account`, and earlier through :func:`check_request` and a
    text run's checks), so such a typo is refused in one line with no run recorded and no ε spent;
    it reads no row and opens no connection, so the refusal is the same whatever the database
    holds."""
    if not name.startswith("sql:"):
        return
    from veil.tables.sources import parse_source, refuse_password_in_url
    from veil.tables.sources.sql_reader import refuse_query_without_check

    refuse_password_in_url(name[4:])
    if query:
        refuse_query_without_check(parse_source(name, query=query))


def check_names(
    name: str,
    *,
    target: str | None = None,
    schema: TableSchema | None = None,
    need_target: bool = True,
    unit_column: str | None = None,
) -> None:
    """The column names a file declares without a row (a CSV's header line, Parquet's schema, an
    ``.npz`` archive's keys) against ``target`` (no schema) or the ``schema`` (both ways, and a privacy
    unit's column, as the table readers check them when they open the file): a job runs it before
    the budget is charged. SQL is left to the reader (it needs a connection)."""
    scheme, _, path = name.partition(":")
    if scheme == "npz" and schema is None:
        from veil.data.tabular import data_file, require_target

        try:
            with np.load(data_file(path), allow_pickle=False) as archive:
                keys = list(archive.files)
        except Exception:
            return  # not an archive numpy reads: the loader refuses it with its own message
        require_target(target or ("y" if "y" in keys else None), "npz", keys)
        return
    if scheme not in ("csv", "parquet") or not path:
        return
    from veil.tables.sources import check_columns, parse_source, source_columns

    source = parse_source(name)
    names = source_columns(source)
    if schema is not None:
        check_columns(schema, names, source.describe(), need_target=need_target)
        if unit_column is not None:
            from veil.tables.units import check_unit_column

            check_unit_column(schema, names, unit_column, source.describe())
        return
    from veil.data.tabular import require_target

    require_target(target, scheme, names)


def _load(
    name: str,
    *,
    data_dir: str | None,
    target: str | None,
    test_fraction: float,
    seed: int,
    classes: list[str] | None,
) -> Dataset:
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

        return load_user(scheme, path, target=target, test_fraction=test_fraction, seed=seed, classes=classes)
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
    privacy_unit: str | None = None,
) -> Dataset:
    """A table read and encoded through its reviewed schema (see :mod:`veil.tables.dataset`); the
    checks that need no row ran already (:func:`check_request`)."""
    from veil.tables.dataset import load_schema_table

    assert schema is not None
    loaded = load_schema_table(name, schema, table=table, query=query, unit_column=privacy_unit)
    x, y, classes = loaded.encoded.x, loaded.encoded.y, loaded.encoded.classes
    assert y is not None
    check_labels(y, classes, "target", count_rows=privacy_unit is None)
    units = None
    if loaded.encoded.units is not None:
        x_tr, y_tr, x_te, y_te, units = split_by_unit(x, y, loaded.encoded.units, test_fraction, seed)
    else:
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
        classes_declared_by="the reviewed schema's target classes (public by declaration)",
        rules=dict(loaded.encoded.rules),
        units_train=units,
        unit_column=privacy_unit,
    )
