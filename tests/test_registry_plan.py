"""The registry holds every run to its plan: the admission boundary, overruns, no un-charge after a read.

* ``reserve``, ``reopen`` and ``veil train`` admit a plan at 0.99× the budget and refuse one at 1.01×
  (a slack in the comparison, e.g. 1.1×, fails these).
* ``commit`` with events beyond the reservation (ε larger, in any accountant that bounds the plan) is
  refused as a normal commit and recorded loudly: the run becomes ``overrun``, charged with what it
  released, and the dataset shows over budget: never a silent excess.
* A job's account (``DatasetCharge``) never un-charges a reservation once a row may have been read:
  a later failure settles the planned events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sqlalchemy")

from veil.accounting.events import Gaussian, PoissonSampled, SelfComposed, event_from_dict
from veil.cli.main import main
from veil.errors import BudgetExhaustedError, RegistryError
from veil.pipeline.private_data import stand_in_plan
from veil.registry.charge import DatasetCharge
from veil.registry.compose import spent_epsilon
from veil.registry.store import BudgetRegistry

DELTA = 1e-5


def dpsgd(q: float, sigma: float, steps: int) -> SelfComposed:
    return SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)


PLAN = [dpsgd(0.01, 1.0, 1000)]


@pytest.fixture
def registry(tmp_path: Path) -> Any:
    with BudgetRegistry(tmp_path / "budget.db") as reg:
        yield reg


def _plan_epsilon() -> float:
    eps = spent_epsilon([PLAN], DELTA)
    assert eps == pytest.approx(1.83, abs=0.01)  # the run: reserved at ε ≈ 1.83
    return eps


# -- the admission boundary ------------------------------------------------------------------------


@pytest.mark.parametrize(("factor", "admitted"), [(1.01, False), (0.99, True)])
def test_reserve_boundary(registry: BudgetRegistry, factor: float, admitted: bool) -> None:
    registry.set_budget("ds", _plan_epsilon() / factor, DELTA)
    if admitted:
        status = registry.reserve("ds", PLAN, "run", delta=DELTA)
        assert [r.run_id for r in status.runs] == ["run"]
    else:
        with pytest.raises(BudgetExhaustedError, match="over its budget"):
            registry.reserve("ds", PLAN, "run", delta=DELTA)
        assert registry.status("ds").runs == ()


@pytest.mark.parametrize(("factor", "admitted"), [(1.01, False), (0.99, True)])
def test_reopen_boundary(registry: BudgetRegistry, factor: float, admitted: bool) -> None:
    registry.set_budget("ds", _plan_epsilon() / factor, DELTA)
    registry.reserve("ds", [dpsgd(0.01, 1.0, 10)], "run", delta=DELTA)
    if admitted:
        registry.reopen("run", PLAN)
        assert registry.run("run").events == tuple(PLAN)
    else:
        with pytest.raises(BudgetExhaustedError, match="nothing was changed"):
            registry.reopen("run", PLAN)
        assert registry.run("run").events == (dpsgd(0.01, 1.0, 10),)


FAST = ["--dataset", "digits", "--model", "logreg", "--epochs", "1", "--no-baseline", "--json"]


def test_train_cli_boundary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs under a declared id: the second, admitted before it reads a row with its stand-in
    (the target ε at δ; its plan needs N), is refused at 1.01× the budget the first run and that
    stand-in compose to, admitted at 0.99×."""
    args = ["train", *FAST, "--epsilon", "0.5", "--dataset-id", "edge"]
    assert main([*args, "--out", str(tmp_path / "first")]) == 0
    capsys.readouterr()
    assert main(["budget", "show", "--dataset-id", "edge", "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    (first,) = status["runs"]
    events = [event_from_dict(e) for e in first["events"]]
    both = spent_epsilon([events, stand_in_plan(0.5, DELTA)], DELTA)
    assert both >= spent_epsilon([events, events], DELTA)  # the stand-in costs no less than the plan
    for factor, code in ((1.01, 2), (0.99, 0)):
        budget = ["budget", "set", "--dataset-id", "edge", "--epsilon", repr(both / factor)]
        budget += ["--delta", "1e-5"]
        assert main(budget) == 0
        capsys.readouterr()
        got = main([*args, "--out", str(tmp_path / f"second-{factor}")])
        err = capsys.readouterr().err
        assert got == code, err
        if code == 2:
            assert "over its budget" in err and not (tmp_path / f"second-{factor}").exists()


# -- commit never exceeds the plan silently ---------------------------------------------------------


def test_a_commit_beyond_the_plan_is_refused_and_recorded_loudly(registry: BudgetRegistry) -> None:
    registry.set_budget("ds", 10.0, DELTA)
    registry.reserve("ds", PLAN, "run", delta=DELTA)
    released = [dpsgd(0.01, 1.0, 1000 * 100)]  # the run: 100× its steps
    with pytest.raises(RegistryError, match="more than it reserved") as err:
        registry.commit("run", released)
    assert "Fix:" in str(err.value)
    status = registry.status("ds")
    (run,) = status.runs
    assert run.status == "overrun" and run.charged  # the history shows it, charged with what it released
    assert run.events == tuple(released)
    assert status.spent_epsilon == pytest.approx(spent_epsilon([released], DELTA), rel=1e-9)
    assert status.spent_epsilon > 10.0 and status.over_budget  # over budget, and said so
    with pytest.raises(RegistryError, match="already settled"):
        registry.commit("run", PLAN)  # an overrun cannot be committed away
    with pytest.raises(BudgetExhaustedError):
        registry.reserve("ds", [dpsgd(0.01, 50.0, 1)], "next", delta=DELTA)


def test_the_overrun_shows_in_budget_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "b.db"
    with BudgetRegistry(db) as reg:
        reg.set_budget("name:ds", 10.0, DELTA)  # the key of a declared --dataset-id ds
        reg.reserve("name:ds", PLAN, "run", delta=DELTA)
        with pytest.raises(RegistryError):
            reg.commit("run", [dpsgd(0.01, 1.0, 2000)])
    assert main(["budget", "show", "--dataset-id", "ds", "--db", str(db), "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    assert [r["status"] for r in status["runs"]] == ["overrun"]


@pytest.mark.parametrize(
    "released",
    [[dpsgd(0.01, 1.0, 500)], [dpsgd(0.01, 1.0, 1000)], [PoissonSampled(0.01, Gaussian(1.0))] * 1000],
    ids=["half", "all", "step-by-step"],
)
def test_a_commit_within_the_plan_commits(registry: BudgetRegistry, released: list) -> None:
    registry.set_budget("ds", 10.0, DELTA)
    registry.reserve("ds", PLAN, "run", delta=DELTA)
    status = registry.commit("run", released)
    assert status.runs[0].status == "committed"


def test_a_larger_sigma_plan_cannot_be_committed_as_smaller_sigma_steps(registry: BudgetRegistry) -> None:
    """Fewer steps but less noise: more ε in every accountant, so an overrun."""
    registry.reserve("ds", PLAN, "run", delta=DELTA)
    with pytest.raises(RegistryError, match="more than it reserved"):
        registry.commit("run", [dpsgd(0.01, 0.6, 500)])
    assert registry.run("run").status == "overrun"


# -- charge before read, never un-charge after --------------------------------------------------------


def _charge(tmp_path: Path) -> DatasetCharge:
    data = tmp_path / "d.csv"
    data.write_text("a,target\n1,0\n2,1\n")
    return DatasetCharge.before_reading(f"csv:{data}", job="train", db=tmp_path / "b.db")


def test_a_reservation_made_after_reading_is_never_released(tmp_path: Path) -> None:
    charge = _charge(tmp_path)
    charge.reserve(PLAN, "read-first", DELTA)  # a DP-SGD plan needs N: rows were read before it
    charge.release()
    run = charge.registry.run("read-first")
    assert run.status == "committed" and run.events == tuple(PLAN)  # settled at its plan
    charge.reserve(PLAN, "finish-none", DELTA)
    charge.finish(None)
    with BudgetRegistry(tmp_path / "b.db") as reg:
        assert reg.run("finish-none").status == "committed"


def test_a_reservation_before_reading_is_released_until_the_first_row(tmp_path: Path) -> None:
    charge = _charge(tmp_path)
    charge.reserve(PLAN, "not-read", DELTA, before_reading=True)
    charge.release()
    assert charge.registry.run("not-read").status == "released"
    charge.reserve(PLAN, "then-read", DELTA, before_reading=True)
    charge.reading()
    charge.release()
    run = charge.registry.run("then-read")
    assert run.status == "committed" and run.events == tuple(PLAN)
    charge.close()
