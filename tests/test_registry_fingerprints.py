"""A named dataset and the file it was read from are one budget (review finding F4), and a dataset's
privacy unit is recorded with a run's reservation, not when its account opens (finding F6.6)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from _budget_cli import cli
from veil.accounting.events import Laplace
from veil.errors import BudgetExhaustedError, ConfigError
from veil.registry.charge import DatasetCharge
from veil.registry.identity import content_fingerprint
from veil.registry.store import BudgetRegistry
from veil.registry.units import unit_of

EPS_1 = Laplace(1.0)  # pure ε = 1
EPS_QUARTER = Laplace(4.0)  # pure ε = 0.25


@pytest.fixture
def data(tmp_path: Path) -> str:
    path = tmp_path / "D.csv"
    path.write_text("pid,age,label\n1,30,yes\n2,40,no\n")
    return f"csv:{path}"


def _run(spec: str, event: Laplace, run_id: str, **where: str) -> str:
    """One job's whole account: open, reserve before reading, settle; returns the id it was charged to."""
    charge = DatasetCharge.before_reading(spec, job="train", **where)
    try:
        charge.reserve([event], run_id, 1e-4, before_reading=True)
        charge.reading()
        charge.finish([event])
    finally:
        charge.close()
    return charge.identity.id


def test_a_run_without_the_name_on_a_named_file_is_charged_to_the_name(
    data: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The review's a5: budget 1.5 on `clinic`, ε = 1 under the id; the same file without the flag.
    code, _, err = cli(capsys, "budget", "set", "--dataset", data, "--dataset-id", "clinic",
                       "--epsilon", "1.5", "--delta", "1e-4")  # fmt: skip
    assert code == 0, err
    assert _run(data, EPS_1, "a", dataset_id="clinic") == "name:clinic"
    assert _run(data, EPS_QUARTER, "c") == "name:clinic"  # no --dataset-id: still the name's budget
    with pytest.raises(BudgetExhaustedError, match="name:clinic"):
        _run(data, EPS_1, "d")  # ε 1 + 0.25 + 1 > 1.5: refused, nothing recorded
    code, out, _ = cli(capsys, "budget", "show", "--json")
    shown = {d["dataset_id"]: d for d in json.loads(out)["datasets"]}
    clinic = shown["name:clinic"]
    assert clinic["jobs"] == {"train": 2} and clinic["spent_epsilon"] == pytest.approx(1.25, abs=0.01)
    assert len(clinic["fingerprints"]) == 1 and clinic["fingerprints"][0].startswith("sha256:")
    assert not any(d["jobs"] for k, d in shown.items() if k.startswith("sha256:"))
    # `show --dataset FILE` answers for the name the file is recorded under.
    code, out, _ = cli(capsys, "budget", "show", "--dataset", data, "--json")
    assert json.loads(out)["datasets"][0]["dataset_id"] == "name:clinic"


def test_a_fingerprint_only_run_over_the_names_budget_is_refused_before_reading(data: str) -> None:
    _run(data, EPS_1, "a", dataset_id="clinic")  # records the file for the name
    with BudgetRegistry() as registry:  # a budget equal to what is spent admits nothing more
        registry.set_budget("name:clinic", registry.status("name:clinic").spent_epsilon, 1e-4)
    with pytest.raises(BudgetExhaustedError, match="name:clinic"):
        DatasetCharge.before_reading(data, job="train")  # exhausted: refused at once


def test_runs_charged_to_the_file_before_it_was_named_count_towards_the_name(data: str) -> None:
    assert _run(data, EPS_1, "early").startswith("sha256:")
    with BudgetRegistry() as registry:
        registry.set_budget("name:clinic", 1.5, 1e-4)
    with pytest.raises(BudgetExhaustedError):
        _run(data, EPS_1, "named", dataset_id="clinic")  # 1 (the file's run) + 1 > 1.5
    with BudgetRegistry() as registry:  # refused: nothing recorded or moved
        assert registry.status("name:clinic").fingerprints == () and not registry.status("name:clinic").runs
    assert _run(data, EPS_QUARTER, "small", dataset_id="clinic") == "name:clinic"
    with BudgetRegistry() as registry:
        status = registry.status("name:clinic")
        assert {r.run_id for r in status.runs} == {"early", "small"}
        assert status.spent_epsilon == pytest.approx(1.25, abs=0.01)


def test_a_file_recorded_under_one_name_is_refused_under_another_before_reading(data: str) -> None:
    _run(data, EPS_QUARTER, "a", dataset_id="clinic")
    with pytest.raises(ConfigError, match="--dataset-id clinic"):
        DatasetCharge.before_reading(data, job="train", dataset_id="other")


def test_sql_sources_stay_name_only(tmp_path: Path) -> None:
    db = tmp_path / "src.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (a INTEGER)")
    spec = f"sql:sqlite:///{db}"
    assert _run(spec, EPS_QUARTER, "named", dataset_id="clinic", table="t") == "name:clinic"
    assert _run(spec, EPS_QUARTER, "located", table="t").startswith("sql:")
    with BudgetRegistry() as registry:
        assert registry.status("name:clinic").fingerprints == ()


def test_a_registry_made_before_the_fingerprint_table_still_opens(data: str, tmp_path: Path) -> None:
    url = tmp_path / "old.db"
    with BudgetRegistry(url) as registry:
        registry.set_budget("name:clinic", 1.5, 1e-4)
    with sqlite3.connect(url) as conn:
        conn.execute("DROP TABLE veil_budget_fingerprints")
    charge = DatasetCharge.before_reading(data, job="train", dataset_id="clinic", db=url)
    charge.reserve([EPS_1], "a", 1e-4, before_reading=True)
    charge.finish([EPS_1])
    with BudgetRegistry(url) as registry:
        assert len(registry.status("name:clinic").fingerprints) == 1


def test_a_unit_is_recorded_with_a_reservation_only(data: str) -> None:
    charge = DatasetCharge.before_reading(data, job="train", dataset_id="people", privacy_unit="pid")
    charge.close()  # refused later (before reserving): nothing about it may stay recorded
    with BudgetRegistry() as registry:
        registry.set_budget("name:people", 0.5, 1e-4)
        assert unit_of(registry.db, "name:people") is None
    charge = DatasetCharge.before_reading(data, job="train", dataset_id="people", privacy_unit="pid")
    with pytest.raises(BudgetExhaustedError):
        charge.reserve([EPS_1], "too-big", 1e-4, before_reading=True)  # refused: no unit recorded
    assert unit_of(charge.registry.db, "name:people") is None
    charge.reserve([EPS_QUARTER], "fits", 1e-4, before_reading=True)
    charge.finish(None)  # released before reading; the unit stays with the reservation's record
    with BudgetRegistry() as registry:
        assert unit_of(registry.db, "name:people") == "pid"


def test_budget_set_with_the_file_and_a_name_moves_the_files_runs_under_the_name(
    data: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(data, EPS_1, "early")
    code, out, err = cli(capsys, "budget", "set", "--dataset", data, "--dataset-id", "clinic",
                         "--epsilon", "1.5", "--delta", "1e-4", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["jobs"] == {"train": 1}  # the file's run is the name's now
    with pytest.raises(BudgetExhaustedError, match="name:clinic"):
        _run(data, EPS_1, "again")  # without the name: charged to it, and 1 + 1 > 1.5


def test_a_refused_budget_set_with_a_unit_writes_nothing(
    data: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """revH's H12: the file has a row-level run; ``budget set --dataset FILE --dataset-id NAME
    --privacy-unit COL`` is refused (row-level spend cannot compose with unit-level runs) and leaves
    the registry as it was: the file is not linked to the name, its run not moved, no unit, no
    budget; the Fix no longer suggests the refused command."""
    _run(data, EPS_1, "early")
    with BudgetRegistry() as registry:
        before = [s.to_dict() for s in registry.statuses()]
    code, _, err = cli(capsys, "budget", "set", "--dataset", data, "--dataset-id", "people",
                       "--privacy-unit", "pid", "--epsilon", "5", "--delta", "1e-4")  # fmt: skip
    assert code == 2 and "row-level" in err and "new --dataset-id" not in err, err
    with BudgetRegistry() as registry:
        assert [s.to_dict() for s in registry.statuses()] == before
        assert registry.name_of(content_fingerprint(data)) is None
