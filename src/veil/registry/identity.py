"""What counts as "the same dataset" for the privacy-budget registry.

A budget is only as good as the identity it is attached to: two runs on the same records must land on
the same registry row, whatever the file is called. The identity is computed *before* any row is read
(only raw bytes are hashed; nothing is parsed), and it is the only thing about the data the registry
stores. Rules, in order:

* ``dataset_id`` given by the user (``--dataset-id NAME``): ``name:NAME``. The data owner's declaration
  wins over everything else; it is the way to keep one budget across versions of a file, across formats
  (the same table as CSV and as Parquet), and across database URLs.
* A file (``csv:PATH``, ``parquet:PATH``, ``npz:PATH`` or a bare path): ``sha256:<hex>``, the SHA-256 of
  the file's bytes. Renaming, moving or copying the file keeps the identity; changing one byte (adding
  a row, re-saving with another quoting) makes a new dataset.
* A directory of files (a partitioned Parquet dataset, an IDX folder): ``dir-sha256:<hex>``, a SHA-256
  over the sorted ``(relative path, file sha256)`` pairs of every regular file under it. Renaming the
  directory keeps the identity; renaming a file inside it does not.
* ``sql:URL`` with ``table`` or ``query``: ``sql:<hex>``, the SHA-256 of the URL *without its password*
  plus the table name or the query with its whitespace collapsed. A database's content changes while
  its address does not, so this identity follows the location: rows added to the table stay charged
  to the same budget (the conservative direction). Two spellings of one server (``localhost`` and
  ``127.0.0.1``), or a table and a query over it, are different identities: declare ``--dataset-id``.
* A built-in public dataset (``digits``, ``breast-cancer``; ``fashion-mnist``/``mnist`` from their
  default folder): ``builtin:<name>``.

A file or folder read under a name is recorded for that name in the registry, and the same bytes read
without ``--dataset-id`` are then charged to the name (:mod:`veil.registry.fingerprints`).

Limits. The identity guards against honest mistakes (a renamed or copied file, a second run that forgot
the first), not against a user who wants to evade the budget: anyone who can read the data can also
edit a byte of it. Data protection then rests on who may train on the data, which the registry records
but does not enforce.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from veil.accounting.ledger import file_sha256
from veil.errors import DataError, InvalidParameterError

__all__ = [
    "FINGERPRINT_KINDS",
    "DatasetIdentity",
    "content_fingerprint",
    "dataset_identity",
    "dataset_key",
    "sql_location",
]

_FILE_SCHEMES = ("csv", "parquet", "npz", "file")
_PUBLIC_BUILTIN = ("digits", "breast-cancer")
_DIR_BUILTIN = {
    "fashion-mnist": "/usr/share/datasets/fashion-mnist",
    "mnist": "/usr/share/datasets/mnist",
}
_PASSWORD_KEYS = ("password", "passwd", "sslpassword")
_MAX_ID = 200
FINGERPRINT_KINDS = ("sha256:", "dir-sha256:")
"""The identities that hash the data's bytes (a file, a folder of files): a name can record them."""


@dataclass(frozen=True)
class DatasetIdentity:
    """A dataset's registry key and a human label (the spec as typed, without any password)."""

    id: str
    label: str


def dataset_key(dataset: DatasetIdentity | str) -> tuple[str, str]:
    """(registry key, label) of a dataset given as an identity or as a stored id."""
    if isinstance(dataset, DatasetIdentity):
        return dataset.id, dataset.label
    if not isinstance(dataset, str) or not dataset.strip() or len(dataset) > 255:
        raise InvalidParameterError(
            "dataset_id",
            dataset,
            "the budget is kept per dataset identity",
            "pass a DatasetIdentity or a non-empty id of at most 255 characters",
        )
    return dataset, dataset


def _sha256_dir(root: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise DataError(
            "dataset",
            str(root),
            "the folder holds no file, so there is no data to attach a budget to",
            "point --dataset at the folder that holds the data files",
        )
    for p in files:
        rel = p.relative_to(root).as_posix()
        h.update(rel.encode("utf-8") + b"\0" + file_sha256(p).encode() + b"\n")
    return h.hexdigest()


def _named(dataset_id: str) -> DatasetIdentity:
    name = dataset_id.strip()
    if not name or len(name) > _MAX_ID or any(ch in name for ch in "\n\r\t"):
        raise InvalidParameterError(
            "dataset_id",
            dataset_id,
            "a declared dataset identity is the key the whole budget hangs on: a short one-line name",
            f"pass a non-empty name of at most {_MAX_ID} characters without tabs or newlines",
        )
    return DatasetIdentity(f"name:{name}", f"name:{name}")


def sql_location(url: str) -> str:
    """The URL as the registry may store and hash it: driver, user, host, port, database; no password."""
    try:
        from sqlalchemy.engine import make_url
    except ModuleNotFoundError:  # pragma: no cover - the tables extra is installed with the registry
        raise InvalidParameterError(
            "dataset", "sql:...", "SQL sources need SQLAlchemy", "reinstall veil: pip install veil"
        ) from None
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InvalidParameterError(
            "dataset", "sql:<url>", "the database URL cannot be parsed", "pass sql:DIALECT://USER@HOST/DB"
        ) from None
    from sqlalchemy.util import immutabledict

    query = immutabledict({k: v for k, v in parsed.query.items() if k.lower() not in _PASSWORD_KEYS})
    # URL.set() treats None as "unchanged", so the password is dropped with the tuple's _replace.
    # The driver suffix (+psycopg) names how veil talks to the server, not the data: not part of identity.
    parsed = parsed._replace(password=None, query=query, drivername=parsed.get_backend_name())
    return parsed.render_as_string(hide_password=False)


def dataset_identity(
    spec: str | None = None,
    *,
    dataset_id: str | None = None,
    table: str | None = None,
    query: str | None = None,
    data_dir: str | Path | None = None,
) -> DatasetIdentity:
    """The registry identity of a dataset spec (see the module doc for the rules)."""
    if dataset_id is not None:
        return _named(dataset_id)
    if not spec:
        raise InvalidParameterError(
            "dataset",
            spec,
            "the budget is kept per dataset and no dataset was named",
            "pass --dataset SPEC or --dataset-id NAME",
        )
    scheme, sep, rest = spec.partition(":")
    if sep and scheme == "sql":
        return _sql_identity(rest, table, query)
    if not sep and spec in _PUBLIC_BUILTIN:
        return DatasetIdentity(f"builtin:{spec}", spec)
    if not sep and spec in _DIR_BUILTIN:
        if data_dir is None or Path(data_dir).resolve() == Path(_DIR_BUILTIN[spec]).resolve():
            return DatasetIdentity(f"builtin:{spec}", spec)
        folder = Path(data_dir)
        if not folder.is_dir():
            raise DataError(
                "data_dir", str(folder), "there is no such folder", "pass the folder of the files"
            )
        return DatasetIdentity(f"dir-sha256:{_sha256_dir(folder)}", f"{spec}:{folder}")
    path = Path(rest if sep and scheme in _FILE_SCHEMES else spec)
    if path.is_file():
        return DatasetIdentity(f"sha256:{file_sha256(path)}", spec)
    if path.is_dir():
        return DatasetIdentity(f"dir-sha256:{_sha256_dir(path)}", spec)
    raise DataError(
        "dataset",
        spec,
        "no such file or folder, so there is nothing to identify and charge",
        "pass an existing file (csv:PATH, parquet:PATH, npz:PATH), a built-in name or sql:URL",
    )


def content_fingerprint(
    spec: str | None,
    *,
    table: str | None = None,
    query: str | None = None,
    data_dir: str | Path | None = None,
) -> str | None:
    """The content identity (``sha256:``/``dir-sha256:``) of the file or folder ``spec`` reads, or None
    for a source without one (SQL, a built-in public dataset, no spec, a path that does not exist).

    A named run records it, so that the file read without the name is charged to the name
    (:mod:`veil.registry.fingerprints`). Hashes raw bytes only, like :func:`dataset_identity`."""
    if not spec or spec.partition(":")[0] == "sql":
        return None
    try:
        found = dataset_identity(spec, table=table, query=query, data_dir=data_dir).id
    except (DataError, InvalidParameterError):
        return None
    return found if found.startswith(FINGERPRINT_KINDS) else None


def _sql_identity(url: str, table: str | None, query: str | None) -> DatasetIdentity:
    if (table is None) == (query is None):
        raise InvalidParameterError(
            "dataset",
            "sql:<url>",
            "a SQL source is identified by its URL and exactly one of a table or a query",
            "pass --table NAME or --query SQL (or declare --dataset-id NAME)",
        )
    location = sql_location(url)
    what = f"table\0{table.strip()}" if table is not None else f"query\0{' '.join(query.split())}"  # type: ignore[union-attr]
    digest = hashlib.sha256(f"{location}\0{what}".encode()).hexdigest()
    shown = f"sql:{location} " + (f"table={table}" if table is not None else "query")
    return DatasetIdentity(f"sql:{digest}", shown)
