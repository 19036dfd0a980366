"""The privacy-budget registry: identity, composition against dp-accounting, admission, the CLI."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from dp_accounting.pld import privacy_loss_distribution as dpa_pld

from veil.accounting.events import Gaussian, Laplace, Neighbouring, PoissonSampled, SelfComposed
from veil.cli.main import main
from veil.errors import (
    BudgetExhaustedError,
    DataError,
    InvalidParameterError,
    RegistryError,
    UnsupportedEventError,
)
from veil.registry import dataset_identity
from veil.registry.compose import compact, spent_epsilon
from veil.registry.location import resolve_url
from veil.registry.store import BudgetRegistry


def dpsgd(q: float, sigma: float, steps: int) -> SelfComposed:
    return SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)


@pytest.fixture
def registry(tmp_path: Path):
    with BudgetRegistry(tmp_path / "budget.db") as reg:
        yield reg


# -- identity ----------------------------------------------------------------------------------------


def test_file_identity_survives_rename_and_copy_but_not_an_edit(tmp_path: Path) -> None:
    a = tmp_path / "patients.csv"
    a.write_bytes(b"age,target\n41,1\n57,0\n")
    first = dataset_identity(f"csv:{a}")
    b = tmp_path / "renamed.csv"
    a.rename(b)
    assert dataset_identity(f"csv:{b}").id == first.id
    assert dataset_identity(str(b)).id == first.id  # bare path, same bytes
    copy = tmp_path / "sub" / "copy.csv"
    copy.parent.mkdir()
    copy.write_bytes(b.read_bytes())
    assert dataset_identity(f"csv:{copy}").id == first.id
    b.write_bytes(b"age,target\n41,1\n57,0\n60,1\n")
    assert dataset_identity(f"csv:{b}").id != first.id
    assert first.id.startswith("sha256:") and "patients" not in first.id


def test_directory_identity_follows_content_not_folder_name(tmp_path: Path) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    (d / "part-0.parquet").write_bytes(b"x" * 10)
    (d / "part-1.parquet").write_bytes(b"y" * 10)
    first = dataset_identity(f"parquet:{d}").id
    d.rename(tmp_path / "moved")
    assert dataset_identity(f"parquet:{tmp_path / 'moved'}").id == first
    (tmp_path / "moved" / "part-1.parquet").write_bytes(b"z" * 10)
    assert dataset_identity(f"parquet:{tmp_path / 'moved'}").id != first


def test_sql_identity_ignores_password_and_driver_and_needs_table_or_query() -> None:
    one = dataset_identity("sql:postgresql://ana:secret1@db.example/clinic", table="patients")
    two = dataset_identity("sql:postgresql+psycopg://ana:other@db.example/clinic", table="patients")
    assert one.id == two.id
    assert "secret1" not in one.label and "secret1" not in one.id
    other_table = dataset_identity("sql:postgresql://ana@db.example/clinic", table="visits")
    assert other_table.id != one.id
    q1 = dataset_identity("sql:sqlite:///c.db", query="SELECT *\n  FROM t")
    q2 = dataset_identity("sql:sqlite:///c.db", query="SELECT * FROM t")
    assert q1.id == q2.id
    with pytest.raises(InvalidParameterError, match="exactly one of a table or a query"):
        dataset_identity("sql:sqlite:///c.db")


def test_declared_identity_wins_and_builtins_are_named(tmp_path: Path) -> None:
    assert dataset_identity("csv:/nonexistent.csv", dataset_id="clinic-2026").id == "name:clinic-2026"
    assert dataset_identity("digits").id == "builtin:digits"
    assert dataset_identity("fashion-mnist").id == "builtin:fashion-mnist"
    (tmp_path / "train.idx").write_bytes(b"private images")
    assert dataset_identity("fashion-mnist", data_dir=tmp_path).id.startswith("dir-sha256:")
    with pytest.raises(DataError):
        dataset_identity("csv:/nonexistent.csv")
    with pytest.raises(InvalidParameterError):
        dataset_identity(None)
    with pytest.raises(InvalidParameterError):
        dataset_identity(dataset_id="two\nlines")


def test_location_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VEIL_BUDGET_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert resolve_url() == f"sqlite:///{tmp_path / 'xdg' / 'veil' / 'budget.db'}"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_url() == f"sqlite:///{tmp_path / 'home' / '.local' / 'share' / 'veil' / 'budget.db'}"
    monkeypatch.setenv("VEIL_BUDGET_DB", "postgresql://team@db/veil")
    assert resolve_url() == "postgresql://team@db/veil"
    assert resolve_url(tmp_path / "x.db") == f"sqlite:///{tmp_path / 'x.db'}"


# -- composition -------------------------------------------------------------------------------------


def test_total_is_composed_like_dp_accounting_not_added(registry: BudgetRegistry) -> None:
    """Two DP-SGD runs: the registry's total equals dp-accounting's PLD of both, well under the sum."""
    runs = [(0.01, 1.1, 800), (0.02, 1.5, 400)]
    for i, (q, s, n) in enumerate(runs):
        registry.reserve("ds", [dpsgd(q, s, n)], f"run-{i}", delta=5e-6)
    status = registry.status("ds")
    assert status.delta == pytest.approx(1e-5)  # no budget: the runs' δ add up
    ref = dpa_pld.from_gaussian_mechanism(runs[0][1], sampling_prob=runs[0][0]).self_compose(runs[0][2])
    ref = ref.compose(
        dpa_pld.from_gaussian_mechanism(runs[1][1], sampling_prob=runs[1][0]).self_compose(runs[1][2])
    )
    assert status.spent_epsilon == pytest.approx(ref.get_epsilon_for_delta(1e-5), rel=0.01)
    alone = [r.epsilon for r in status.runs]
    assert status.spent_epsilon < sum(alone) - 0.2  # composition, not addition


def test_compact_merges_ledger_steps_without_changing_epsilon() -> None:
    step = PoissonSampled(0.05, Gaussian(1.2))
    steps = [step] * 300 + [Laplace(4.0)] + [step] * 100
    merged = compact(steps)
    assert merged == [SelfComposed(step, 400), Laplace(4.0)]
    assert spent_epsilon([steps], 1e-5) == pytest.approx(spent_epsilon([merged], 1e-5), rel=1e-9)


# -- admission ---------------------------------------------------------------------------------------


def test_run_over_remaining_budget_is_refused_and_nothing_recorded(registry: BudgetRegistry) -> None:
    registry.set_budget("ds", 2.0, 1e-5)
    first = registry.reserve("ds", [dpsgd(0.01, 1.0, 500)], "a", delta=1e-5)
    assert 0 < first.spent_epsilon <= 2.0
    with pytest.raises(BudgetExhaustedError, match="over its budget") as err:
        registry.reserve("ds", [dpsgd(0.01, 1.0, 2000)], "b", delta=1e-5)
    assert "nothing was released or recorded" in str(err.value)
    after = registry.status("ds")
    assert [r.run_id for r in after.runs] == ["a"]
    assert after.spent_epsilon == pytest.approx(first.spent_epsilon)
    small = registry.reserve("ds", [dpsgd(0.01, 3.0, 200)], "c", delta=1e-5)
    assert small.spent_epsilon <= 2.0 and small.remaining_epsilon == pytest.approx(2.0 - small.spent_epsilon)


def test_crashed_run_stays_charged_commit_replaces_plan_release_uncharges(tmp_path: Path) -> None:
    db = tmp_path / "b.db"
    with BudgetRegistry(db) as reg:
        reg.set_budget("ds", 8.0, 1e-5)
        reg.reserve("ds", [dpsgd(0.02, 1.0, 1000)], "crashed")
        reg.reserve("ds", [dpsgd(0.02, 1.0, 1000)], "finished")
        reg.reserve("ds", [dpsgd(0.02, 1.0, 1000)], "refused-early")
        planned_total = reg.status("ds").spent_epsilon
    # A new process (a new connection) sees the crashed run still charged with its whole plan.
    with BudgetRegistry(db) as reg:
        half = [PoissonSampled(0.02, Gaussian(1.0))] * 500
        done = reg.commit("finished", half)
        assert done.spent_epsilon < planned_total
        released = reg.release("refused-early")
        by_id = {r.run_id: r for r in released.runs}
        assert by_id["crashed"].status == "reserved" and by_id["crashed"].charged
        assert by_id["finished"].events == (SelfComposed(PoissonSampled(0.02, Gaussian(1.0)), 500),)
        assert not by_id["refused-early"].charged and by_id["refused-early"].epsilon is None
        expected = spent_epsilon([[dpsgd(0.02, 1.0, 1000)], half], 1e-5)
        assert released.spent_epsilon == pytest.approx(expected, rel=1e-9)
        with pytest.raises(RegistryError, match="already settled"):
            reg.commit("finished", half)
        with pytest.raises(RegistryError, match="only a reserved run"):
            reg.release("finished")
        with pytest.raises(RegistryError, match="no such run"):
            reg.commit("never-reserved", half)


def test_refusals_that_protect_the_composition(registry: BudgetRegistry) -> None:
    registry.reserve("ds", [Laplace(1.0)], "a")
    with pytest.raises(RegistryError, match="already recorded"):
        registry.reserve("ds", [Laplace(1.0)], "a")
    with pytest.raises(InvalidParameterError, match="different relations"):
        registry.reserve("ds", [Laplace(1.0)], "b", neighbouring=Neighbouring.REPLACE_ONE)
    registry.set_budget("rdp-ds", 10.0, 1e-5, accountant="rdp")
    with pytest.raises(UnsupportedEventError):  # RDP has no bound for a sampled Laplace
        registry.reserve("rdp-ds", [PoissonSampled(0.1, Laplace(1.0))], "c")
    assert registry.status("rdp-ds").runs == ()
    with pytest.raises(InvalidParameterError):
        registry.set_budget("ds", -1.0, 1e-5)
    with pytest.raises(InvalidParameterError):
        registry.set_budget("ds", 1.0, 1.5)


def test_budget_below_spend_shows_over_budget_and_admits_nothing(registry: BudgetRegistry) -> None:
    registry.reserve("ds", [Laplace(1.0)], "a")
    status = registry.set_budget("ds", 0.5, 1e-6)
    assert status.over_budget and status.remaining_epsilon == 0.0
    with pytest.raises(BudgetExhaustedError):
        registry.reserve("ds", [Laplace(100.0)], "b")


def test_registry_stores_no_data(tmp_path: Path) -> None:
    data = tmp_path / "d.csv"
    data.write_text("name,target\nZEBRA-MARKER-7731,1\n")
    identity = dataset_identity(f"csv:{data}")
    db = tmp_path / "b.db"
    with BudgetRegistry(db) as reg:
        reg.set_budget(identity, 1.0, 1e-5)
        reg.reserve(identity, [Laplace(2.0)], "r", delta=1e-6)
        reg.commit("r", [Laplace(2.0)])
    assert b"ZEBRA-MARKER" not in db.read_bytes()
    with sqlite3.connect(db) as conn:
        cols = {
            t: [c[1] for c in conn.execute(f"PRAGMA table_info({t})")]
            for t in ("veil_budget_datasets", "veil_budget_runs")
        }
    assert cols["veil_budget_datasets"] == (
        ["dataset_id", "label", "epsilon", "delta", "accountant", "neighbouring", "created_at", "updated_at"]
    )
    assert cols["veil_budget_runs"] == (
        [
            "run_id",
            "dataset_id",
            "job",
            "status",
            "planned_events",
            "events",
            "delta",
            "created_at",
            "finished_at",
        ]
    )


# -- the command line --------------------------------------------------------------------------------


def test_cli_set_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.csv"
    data.write_text("a,target\n1,0\n")
    db = str(tmp_path / "b.db")
    assert (
        main(["budget", "set", "--dataset", f"csv:{data}", "--epsilon", "4", "--delta", "1e-6", "--db", db])
        == 0
    )
    with BudgetRegistry(db) as reg:
        reg.reserve(dataset_identity(f"csv:{data}"), [dpsgd(0.01, 1.0, 500)], "run-1", delta=1e-6)
        reg.reserve(dataset_identity(f"csv:{data}"), [dpsgd(0.01, 1.0, 500)], "run-2", delta=1e-6)
    capsys.readouterr()
    moved = tmp_path / "moved.csv"
    data.rename(moved)
    assert main(["budget", "show", "--dataset", f"csv:{moved}", "--json", "--db", db]) == 0
    shown = json.loads(capsys.readouterr().out)
    (status,) = shown["datasets"]
    assert status["epsilon_budget"] == 4.0 and [r["run_id"] for r in status["runs"]] == ["run-1", "run-2"]
    assert status["spent_epsilon"] == pytest.approx(spent_epsilon([[dpsgd(0.01, 1.0, 1000)]], 1e-6))
    assert status["remaining_epsilon"] == pytest.approx(4.0 - status["spent_epsilon"])
    assert main(["budget", "show", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "run-2" in text and "spent ε" in text and "remaining ε" in text


def test_cli_unreachable_database_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "postgresql://ana:hunter2@127.0.0.1:1/veil"
    assert main(["budget", "show", "--db", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "budget registry" in err and "hunter2" not in err
    assert main(["budget", "show", "--db", "mysql://x@y/z"]) == 2
    assert main(["budget", "set", "--dataset", "csv:/nope.csv", "--epsilon", "1", "--delta", "1e-5",
                 "--db", str(tmp_path / "b.db")]) == 2  # fmt: skip
    assert "no such file" in capsys.readouterr().err


def test_infinite_spend_is_reported(registry: BudgetRegistry) -> None:
    from veil.accounting.events import NonPrivate

    status = registry.reserve("ds", [NonPrivate()], "baseline", delta=1e-5)
    assert math.isinf(status.spent_epsilon)
    registry.set_budget("ds", 100.0, 1e-5)
    assert registry.status("ds").over_budget


# -- a job's account (veil.registry.charge) ----------------------------------------------------------


def test_job_charge_refuses_an_exhausted_dataset_before_reading(tmp_path: Path) -> None:
    from veil.registry.charge import DatasetCharge

    data = tmp_path / "d.csv"
    data.write_text("a,target\n1,0\n")
    db = tmp_path / "b.db"
    charge = DatasetCharge.before_reading(f"csv:{data}", job="train", db=db)
    charge.reserve([Laplace(1.0)], "first", delta=1e-6)
    charge.settle([Laplace(1.0)])
    charge.close()
    with BudgetRegistry(db) as reg:
        reg.set_budget(dataset_identity(f"csv:{data}"), 0.9, 1e-6)  # the first run spent all of it
    with pytest.raises(BudgetExhaustedError, match="refused before any row was parsed"):
        DatasetCharge.before_reading(f"csv:{data}", job="train", db=db)
    with BudgetRegistry(db) as reg:
        reg.set_budget(dataset_identity(f"csv:{data}"), 3.0, 1e-6)
    charge = DatasetCharge.before_reading(f"csv:{data}", job="train", db=db)
    charge.reserve([Laplace(1.0)], "second", delta=1e-6)
    charge.release()  # ended before releasing anything
    charge.resume("third", [Laplace(1.0)], delta=1e-6)  # unknown to the registry: reserved now
    assert charge.registry.run("third").status == "reserved"
    charge.settle([Laplace(2.0)])
    charge.resume("third", [Laplace(1.5)], delta=1e-6)  # settled, then resumed: charged with its plan again
    assert charge.registry.run("third").events == (Laplace(1.5),)
    with pytest.raises(BudgetExhaustedError, match="nothing was changed"):
        charge.registry.reopen("third", [Laplace(0.1)])
    assert charge.registry.run("third").events == (Laplace(1.5),)
    charge.settle([Laplace(2.0)])
    assert charge.registry.run("third").status == "committed"
    charge.close()


def test_without_sqlalchemy_the_commands_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "veil.registry.store", None)  # as if SQLAlchemy were missing
    assert main(["budget", "show", "--db", str(tmp_path / "b.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SQLAlchemy" in err and "pip install veil" in err
