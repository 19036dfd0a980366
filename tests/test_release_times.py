"""``release/`` tells no time the run's length moves (revH's H6).

A file's modification time minus the run's public reservation time (``dataset_budget.runs[].at``) was
the run's duration: for ``veil tune`` the number of trials (its bound assumes it secret), for every job
the wall time ``public_view`` withholds. Every file in ``release/`` and the folder itself carry the
reservation time (:func:`veil.report.publish.release_time`), and ``at`` is the reservation time for
every run, never its end (which with the start in the run's own report would give its duration).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sqlalchemy")


@pytest.mark.parametrize("job", ["train", "synth", "tune"])
def test_every_released_file_is_dated_the_reservation_time(job: str, job_runs: Any) -> None:
    out, _ = job_runs(job)
    release = out / "release"
    public = json.loads((release / "report.json").read_text())
    (this,) = [r for r in public["dataset_budget"]["runs"] if r["this_run"]]
    at = datetime.fromisoformat(this["at"].replace("Z", "+00:00")).timestamp()
    for path in [release, *release.iterdir()]:
        assert path.stat().st_mtime == at, path


def test_a_runs_at_is_its_reservation_time_once_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget section of a later report (or ``veil budget report``'s public figures) states an
    earlier run's ``at`` as its start, the same value its own release stated."""
    from veil.accounting.events import Laplace
    from veil.registry.charge import DatasetCharge
    from veil.registry.reporting import budget_section
    from veil.registry.store import BudgetRegistry

    data = tmp_path / "d.csv"
    data.write_text("a,y\n1,0\n2,1\n")
    charge = DatasetCharge.before_reading(f"csv:{data}", job="train", dataset_id="clinic")
    charge.reserve([Laplace(1.0)], "early", 1e-4, before_reading=True)
    during = charge.budget_section(None, None)["runs"][0]["at"]
    charge.reading()
    monkeypatch.setattr("veil.registry.transactions.now", lambda: "2099-01-01T00:00:00Z")  # a long run
    charge.finish([Laplace(1.0)])
    with BudgetRegistry() as registry:
        status = registry.status("name:clinic")
        (run,) = status.runs
        after = budget_section(status, None)["runs"][0]["at"]
    assert run.finished_at == "2099-01-01T00:00:00Z"
    assert after == during == run.created_at


def test_a_later_runs_public_report_does_not_tell_whether_an_earlier_run_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """revJ's J6: run B's public budget section lists run A, admitted before it, without A's status
    ("reserved" while A runs, "committed" once it ends: a bound on A's duration), and leaves out run C,
    admitted after B (there only if B was still running: B's duration). B's public section is the same
    whether A has ended or not; the internal section keeps A's live status."""
    from itertools import count

    from veil.accounting.events import Gaussian
    from veil.registry.charge import DatasetCharge
    from veil.report.schema import public_view

    clock = count()
    monkeypatch.setattr("veil.registry.transactions.now", lambda: f"2030-01-01T00:00:{next(clock):02d}Z")
    data = tmp_path / "d.csv"
    data.write_text("a,y\n1,0\n2,1\n")
    plan = [Gaussian(2.0)]

    def admitted(run_id: str) -> DatasetCharge:
        charge = DatasetCharge.before_reading(f"csv:{data}", job="train", dataset_id="clinic")
        charge.reserve(plan, run_id, 1e-5, before_reading=True)
        charge.reading()
        return charge

    a, b = admitted("a"), admitted("b")

    def b_sections() -> tuple[dict[str, Any], dict[str, Any]]:
        internal = b.budget_section(plan, tmp_path / "b")
        return internal, public_view({"job": "train", "dataset_budget": internal})["dataset_budget"]

    internal_running, public_running = b_sections()
    c = admitted("c")  # admitted while B runs
    a.finish(plan)  # A ends, having released its plan
    internal_ended, public_ended = b_sections()
    assert public_running == public_ended
    assert [r["run_id"] for r in public_ended["runs"]] == ["a", "b"]
    assert "status" not in public_ended["runs"][0] and public_ended["runs"][1]["status"] == "reserved"
    assert public_ended["spent_epsilon"] == internal_running["spent_epsilon"]
    assert [r["status"] for r in internal_running["runs"]] == ["reserved", "reserved"]
    assert [r["status"] for r in internal_ended["runs"]] == ["committed", "reserved"]  # live, internally
    json.dumps(public_ended)  # as release/report.json holds it
    b.finish(plan)
    c.finish(plan)


def test_the_zip_the_docs_say_to_publish_holds_no_time_but_at(job_runs: Any, tmp_path: Path) -> None:
    """revJ's J2: the files' ctime (the time the release was written; no call sets it) is outside the
    guarantee, so docs/train.md says to publish a zip made with ``python -m zipfile -c``: its entries
    carry the modification time alone (``at``, to the zip's 2 s) and no extra field (no ctime, atime)."""
    import subprocess
    import sys
    import zipfile

    out, _ = job_runs("train")
    public = json.loads((out / "release" / "report.json").read_text())
    (this,) = [r for r in public["dataset_budget"]["runs"] if r["this_run"]]
    at = datetime.fromisoformat(this["at"].replace("Z", "+00:00")).timestamp()
    archive = tmp_path / "release.zip"
    subprocess.run([sys.executable, "-m", "zipfile", "-c", str(archive), "release/"], cwd=out, check=True)
    entries = zipfile.ZipFile(archive).infolist()
    assert {e.filename for e in entries} >= {"release/report.json", "release/model.pt"}
    for entry in entries:
        written = datetime(*entry.date_time).timestamp()  # a zip's times are local, to 2 s
        assert at - 2 < written <= at and entry.extra == b"", entry
