"""The crash-safe privacy ledger of a training run, the run-folder lock and atomic file writes.

Guarantee. Every privacy-relevant release of a run (each DP-SGD step, each DP preprocessing
statistic) is appended to the ledger as a JSON line *and flushed to disk with fsync* before the
release is computed or any result depending on it is applied or saved. So whatever survives a crash
(a checkpoint, weights, a report) was accounted in the ledger, and the ledger's events, composed by
an accountant, upper-bound the privacy spent by every release that ever happened, including steps
whose updates were lost in the crash.

Integrity. Each line carries ``seq`` (0, 1, 2, ...), ``prev`` (the previous line's hash) and
``hash = sha256(prev + canonical JSON of the line without its hash)``: a hash chain from the header.
A line that does not parse, breaks the sequence or the chain is corruption and raises
:class:`~veil.errors.LedgerError`; the ledger is never silently reset. One case is not corruption:
a final line cut short without its newline, the trace of a process killed in the middle of an
append. Its release cannot have happened (it waits for the fsync), but to stay conservative
:meth:`Ledger.open` with ``repair=True`` replaces it by a ``recovered`` record charged as one more
step event.

Locking. :class:`RunLock` takes an exclusive ``flock`` on ``<run>/.lock`` so that two processes
cannot write one run folder (and spend its budget twice) at once; the kernel releases it when the
holder dies, so a killed run can be resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from veil.accounting.events import PrivacyEvent, event_from_dict
from veil.errors import LedgerError, VeilError

__all__ = [
    "GENESIS",
    "Ledger",
    "RunLock",
    "atomic_write_bytes",
    "atomic_write_text",
    "file_sha256",
]

GENESIS = "0" * 64
FORMAT = "veil.ledger/1"
_FIX_CORRUPT = (
    "restore the run folder from a backup, then --resume; a damaged ledger cannot prove how much "
    "budget was spent, so count the run's whole target ε as spent on its data (`veil budget`)"
)


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(
        record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _chain_hash(prev: str, body: dict[str, Any]) -> str:
    return hashlib.sha256(prev.encode() + _canonical(body)).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` all-or-nothing: temp file in the same folder, fsync, rename.
    ``mode``: the file's permission bits (default: what the umask at import allows)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, _FILE_MODE if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class RunLock:
    """Exclusive lock of a run folder (``flock`` on ``<run>/.lock``); a context manager."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._fh: BinaryIO | None = None

    def acquire(self) -> RunLock:
        fh = self.path.open("ab")
        try:
            import fcntl
        except ModuleNotFoundError:  # pragma: no cover - not POSIX: no advisory locks
            self._fh = fh
            return self
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise LedgerError(
                "run folder",
                str(self.path.parent),
                "another veil process is writing this run folder; two writers could each spend its budget",
                "wait for the other run to finish (a second run would spend the dataset's budget again)",
            ) from None
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the descriptor drops the flock
            self._fh = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Ledger:
    """Append-only, hash-chained, fsync'ed JSON-lines record of a run's privacy events.

    Record kinds: ``header`` (first line: the run's privacy settings, ``step_event``), ``event`` (a
    one-off release such as a DP preprocessing statistic), ``step`` (one DP-SGD step), ``recovered``
    (an interrupted append, charged as a step), ``checkpoint`` (the sha256 of a checkpoint file) and
    ``end``. Every record with an ``event`` field is charged by :meth:`events`.
    """

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path = Path(path)
        self.records = records
        self._fh: BinaryIO | None = None

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, header: dict[str, Any]) -> Ledger:
        """A new ledger whose first line is ``header``; refuses to overwrite an existing one."""
        path = Path(path)
        if path.exists():
            raise LedgerError(
                "ledger",
                str(path),
                "a ledger already exists here; overwriting it would forget spent budget",
                "use --resume",
            )
        if "step_event" in header:
            event_from_dict(header["step_event"])  # validated before anything is written
        ledger = cls(path, [])
        ledger._fh = path.open("xb")
        _fsync_dir(path.parent)
        ledger.append("header", format=FORMAT, **header)
        return ledger

    @classmethod
    def open(cls, path: Path, repair: bool = False) -> Ledger:
        """Read and verify a ledger. ``repair=True`` also opens it for appending (see the module doc)."""
        path = Path(path)
        if not path.is_file():
            raise LedgerError(
                "ledger", str(path), "there is no ledger, so no run to continue", "check the folder name"
            )
        data = path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        records: list[dict[str, Any]] = []
        prev = GENESIS
        for i, line in enumerate(lines):
            record = _parse(line, i, path)
            body = {k: v for k, v in record.items() if k != "hash"}
            if (
                record.get("seq") != i
                or record.get("prev") != prev
                or record.get("hash") != _chain_hash(prev, body)
            ):
                raise LedgerError(
                    f"ledger line {i + 1}",
                    str(path),
                    "its sequence number or checksum does not match "
                    "the chain: the ledger was modified or damaged",
                    _FIX_CORRUPT,
                )
            prev = record["hash"]
            records.append(record)
        if not records or records[0].get("kind") != "header" or records[0].get("format") != FORMAT:
            raise LedgerError(
                "ledger", str(path), "it does not start with a veil ledger header", _FIX_CORRUPT
            )
        ledger = cls(path, records)
        try:
            ledger.events()
        except VeilError as exc:
            raise LedgerError(
                "ledger", str(path), f"it holds an unreadable privacy event ({exc})", _FIX_CORRUPT
            ) from None
        if torn and not repair:
            raise LedgerError(
                "ledger",
                str(path),
                "its last line was cut short by an interrupted write",
                "resume the run (veil train --resume) to charge the interrupted step and continue",
            )
        if repair:
            if torn:
                with path.open("r+b") as fh:
                    fh.truncate(len(data) - len(torn))
                    fh.flush()
                    os.fsync(fh.fileno())
            ledger._fh = path.open("ab")
            if torn:
                ledger.append(
                    "recovered",
                    event=records[0]["step_event"],
                    reason="interrupted append: its release cannot have happened, but is charged as a step",
                )
        return ledger

    # -- writing ---------------------------------------------------------------------------------
    def append(self, kind: str, **payload: Any) -> dict[str, Any]:
        """Append one record and fsync it; returns the record. Events are validated first."""
        if self._fh is None:
            raise LedgerError(
                "ledger", str(self.path), "it is open read-only", "open it with repair=True to append"
            )
        if "event" in payload:
            event_from_dict(payload["event"])
        prev = self.records[-1]["hash"] if self.records else GENESIS
        body = {"seq": len(self.records), "kind": kind, **payload, "prev": prev}
        record = {**body, "hash": _chain_hash(prev, body)}
        self._fh.write(_canonical(record) + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records.append(record)
        return record

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- reading ---------------------------------------------------------------------------------
    @property
    def header(self) -> dict[str, Any]:
        return self.records[0]

    def events(self) -> list[PrivacyEvent]:
        """Every charged event, in order (steps, recovered steps, one-off releases)."""
        return [event_from_dict(r["event"]) for r in self.records if "event" in r]

    @property
    def steps(self) -> int:
        """DP-SGD steps charged so far (``step`` and ``recovered`` records)."""
        return sum(1 for r in self.records if r["kind"] in ("step", "recovered"))

    def of_kind(self, kind: str) -> Iterator[dict[str, Any]]:
        return (r for r in self.records if r["kind"] == kind)

    def last(self, kind: str) -> dict[str, Any] | None:
        for r in reversed(self.records):
            if r["kind"] == kind:
                return r
        return None


def _parse(line: bytes, i: int, path: Path) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict):
        raise LedgerError(
            f"ledger line {i + 1}", str(path), "it is not a JSON record: the ledger is damaged", _FIX_CORRUPT
        )
    return record
