"""The run ledger: hash chain, tamper detection, torn-tail recovery (charged), locking, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veil.accounting.events import Gaussian, PoissonSampled
from veil.accounting.ledger import Ledger, RunLock, atomic_write_bytes
from veil.errors import LedgerError

STEP = PoissonSampled(0.25, Gaussian(1.5))


def _ledger(tmp_path: Path, steps: int = 3) -> Path:
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger.create(path, {"step_event": STEP.to_dict(), "delta": 1e-5})
    ledger.append("event", label="preprocessing", event=Gaussian(20.0).to_dict())
    for k in range(steps):
        ledger.append("step", step=k + 1, event=STEP.to_dict())
    ledger.append("checkpoint", charged=steps, file="c.pt", sha256="0" * 64)
    ledger.close()
    return path


def test_round_trip_counts_and_events(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    ledger = Ledger.open(path)
    assert ledger.steps == 3
    assert ledger.events() == [Gaussian(20.0), STEP, STEP, STEP]
    assert ledger.header["delta"] == 1e-5 and ledger.last("checkpoint")["charged"] == 3  # type: ignore[index]
    with pytest.raises(LedgerError, match="read-only"):
        ledger.append("step", event=STEP.to_dict())


def test_create_never_overwrites(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="already exists"):
        Ledger.create(path, {"step_event": STEP.to_dict()})
    assert path.read_bytes() == before


def _rewrite(path: Path, index: int, mutate: object) -> None:
    lines = path.read_text().splitlines()
    record = json.loads(lines[index])
    mutate(record)  # type: ignore[operator]
    lines[index] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["event"].update(sampling_rate=0.01),  # an event made cheaper
        lambda r: r.update(step=99),  # any field
        lambda r: r.update(seq=7),  # reordering
    ],
)
def test_any_edit_breaks_the_chain(tmp_path: Path, damage: object) -> None:
    path = _ledger(tmp_path)
    _rewrite(path, 2, damage)
    with pytest.raises(LedgerError, match="ledger line 3"):
        Ledger.open(path, repair=True)


def test_deleted_or_garbled_lines_are_refused(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")  # one step forgotten
    with pytest.raises(LedgerError, match="checksum"):
        Ledger.open(path)
    path.write_text("\n".join([*lines[:2], "{not json", *lines[3:]]) + "\n")
    with pytest.raises(LedgerError, match="not a JSON record"):
        Ledger.open(path)
    path.write_text("")
    with pytest.raises(LedgerError, match="header"):
        Ledger.open(path)


def test_torn_tail_is_charged_as_a_step_not_dropped(tmp_path: Path) -> None:
    path = _ledger(tmp_path)
    with path.open("ab") as fh:
        fh.write(b'{"seq":6,"kind":"step","ev')  # killed in the middle of an append
    with pytest.raises(LedgerError, match="cut short"):
        Ledger.open(path)
    repaired = Ledger.open(path, repair=True)
    assert repaired.steps == 4  # 3 recorded + the interrupted one, conservatively
    assert repaired.records[-1]["kind"] == "recovered"
    repaired.close()
    assert Ledger.open(path).steps == 4  # and the repaired file verifies


def test_run_lock_excludes_a_second_writer(tmp_path: Path) -> None:
    with RunLock(tmp_path), pytest.raises(LedgerError, match="another veil process"):
        RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # free again once released


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
