"""``veil federated`` charges its dataset in the budget registry (``veil.federated.charge``).

The runs go through the command with Flower's ServerApp and ClientApp driven in-process
(``_fake_grid.InProcessGrid`` in place of the simulation engine: the same apps, no Ray start-up).
The composed totals are checked against dp-accounting; a run over the remaining budget is refused
with one line, exit status 2, nothing written and nothing charged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import RdpAccountant

from _budget_cli import cli as _cli
from _budget_cli import show as _show
from _fake_grid import InProcessGrid
from veil.accounting.rdp import DEFAULT_ORDERS
from veil.errors import RegistryError
from veil.federated.partition import parse_partition, row_positions, split_rows


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's engine runs the same ServerApp/ClientApp code on an in-process grid."""
    import veil.federated.run as run
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve

    def engine(s, cpus: int = 2) -> None:
        serve(InProcessGrid(make_client_app(s), s.clients), s)

    monkeypatch.setattr(run, "run_simulation_engine", engine)


CLIENT = ("federated", "--dataset", "digits", "--model", "logreg", "--clients", "3", "--rounds", "2",
          "--epsilon", "8", "--delta", "1e-3", "--seed", "1", "--json")  # fmt: skip
SILOS = ("federated", "--mode", "record-level", "--dataset", "digits", "--model", "logreg", "--clients", "3",
         "--rounds", "2", "--local-steps", "3", "--local-batch", "32", "--epsilon", "4", "--delta", "1e-4",
         "--seed", "1", "--json")  # fmt: skip


def _pld(events: list, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def _rdp(events: list, delta: float) -> float:
    acc = RdpAccountant(orders=list(DEFAULT_ORDERS))
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def _step(q: float, sigma: float, n: int) -> dpe.DpEvent:
    return dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), n)


@pytest.mark.parametrize("partition", ["iid", "dirichlet:0.3"])
def test_adding_a_row_changes_exactly_one_clients_data(partition: str) -> None:
    """The registry's relation (add/remove one row of the dataset) is one client's change, by that row."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    x2, y2 = np.vstack([x[:17], rng.normal(size=(1, 4)), x[17:]]), np.concatenate([y[:17], [2], y[17:]])

    def clients(xs: np.ndarray, ys: np.ndarray) -> list[set[bytes]]:
        parts = split_rows(parse_partition(partition), ys, 5, seed=3, positions=row_positions(xs, ys, 3),
                           num_classes=3)  # fmt: skip
        return [{xs[i].tobytes() for i in p} for p in parts]

    before, after = clients(x, y), clients(x2, y2)
    changed = [k for k in range(5) if before[k] != after[k]]
    assert len(changed) == 1 and after[changed[0]] - before[changed[0]] == {x2[17].tobytes()}
    assert sum(len(c) for c in before) == 60


def test_federated_runs_show_in_budget_show_composed_as_dp_accounting_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], in_process: None
) -> None:
    assert _cli(capsys, "budget", "set", "--dataset", "digits", "--epsilon", "100", "--delta", "1e-5")[0] == 0
    code, out, err = _cli(capsys, *CLIENT, "--out", str(tmp_path / "fl"))
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    sigma = report["plan"]["noise_multiplier"]
    assert report["guarantee"]["rounds_charged"] == 2
    header = json.loads((tmp_path / "fl" / "ledger.jsonl").read_text().splitlines()[0])
    status = _show(capsys, "digits")
    assert status["jobs"] == {"federated": 1}
    (run,) = status["runs"]
    assert run["run_id"] == header["budget_run_id"] and run["status"] == "committed"
    # Client level, charged per record: each round a Gaussian of sensitivity 2C (σ/2), no amplification.
    clients = [dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(sigma / 2), 2)]
    assert status["spent_epsilon"] == pytest.approx(min(_pld(clients, 1e-5), _rdp(clients, 1e-5)), rel=0.01)

    code, out, err = _cli(capsys, *SILOS, "--out", str(tmp_path / "silos"))
    assert code == 0, err
    silos = json.loads((tmp_path / "silos" / "silos.json").read_text())
    plans = sorted({(v["sampling_rate"], v["noise_multiplier"]) for v in silos.values()})
    assert len(plans) == 3  # silos of different sizes: q = B/n and σ differ
    status = _show(capsys, "digits")
    assert status["jobs"] == {"federated": 2}
    # Parallel composition: every silo's 6 steps, composed with the first run, stay within the charge.
    each = [_pld([*clients, _step(q, s, 6)], 1e-5) for q, s in plans]
    assert status["spent_epsilon"] >= max(each) * (1 - 0.01)  # 1%: the reference's coarser grid
    # The charge is the cheaper sound bound: 6 steps at the largest q and the smallest σ (PLD), or the
    # largest of the silos' RDP curves; here (three silos of nearly one size) the first.
    q_max, s_min = max(q for q, _ in plans), min(s for _, s in plans)
    dominating = [*clients, _step(q_max, s_min, 6)]
    assert status["spent_epsilon"] == pytest.approx(min(_pld(dominating, 1e-5), _rdp(dominating, 1e-5)),
                                                    rel=0.01)  # fmt: skip
    assert status["spent_epsilon"] < max(each) * 1.1  # and not far above the exact parallel composition


def test_a_federated_run_over_the_remaining_budget_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], in_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.federated.local as local

    assert _cli(capsys, "budget", "set", "--dataset", "digits", "--epsilon", "2", "--delta", "1e-5")[0] == 0

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("the dataset was read")

    local._federation.cache_clear()
    monkeypatch.setattr(local, "load_dataset", must_not_read)
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *CLIENT, "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "budget" in err, err
    assert not out.exists()
    assert _show(capsys, "digits")["runs"] == []
    # A declared identity is charged instead of the computed one (as veil train --dataset-id).
    declared = ("--dataset-id", "clinic")
    assert _cli(capsys, "budget", "set", *declared, "--epsilon", "2", "--delta", "1e-5")[0] == 0
    code, _, err = _cli(capsys, *CLIENT, *declared, "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "name:clinic" in err, err
    assert not out.exists()


def test_a_record_level_run_over_budget_is_refused_with_nothing_written_or_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], in_process: None
) -> None:
    assert _cli(capsys, "budget", "set", "--dataset", "digits", "--epsilon", "1", "--delta", "1e-5")[0] == 0
    out = tmp_path / "silos"
    code, _, err = _cli(capsys, *SILOS, "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "budget" in err, err
    assert not out.exists()
    assert _show(capsys, "digits")["runs"] == []


TYPO_SCHEMA = """
reviewed = true
[columns.a]
type = "numeric"
bounds = [-3.0, 3.0]
[columns.y]
role = "target"
clases = ["0", "1"]
"""


@pytest.mark.parametrize("mode", ["record-level", "client-level"])
@pytest.mark.parametrize("mistake", ["schema typo", "no label set"])
def test_public_mistakes_are_refused_before_anything_is_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, mistake: str
) -> None:
    """A typo in the reviewed schema, a table without a declared label set: refused as by ``veil
    train``, one line, exit 2, before the run is charged (review revA, finding 5: the record-level
    stand-in used to be reserved, then marked read, before these checks)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "d.csv"
    data.write_text("a,y\n" + "".join(f"{rng.normal():.3f},{int(rng.integers(0, 2))}\n" for _ in range(60)))
    (tmp_path / "bad.toml").write_text(TYPO_SCHEMA)
    extra = ("--schema", str(tmp_path / "bad.toml")) if mistake == "schema typo" else ("--target", "y")
    out = tmp_path / "fl"
    argv = ("federated", "--mode", mode, "--dataset", f"csv:{data}", *extra, "--clients", "3", "--rounds",
            "2", "--epsilon", "4", "--delta", "1e-3", "--out", str(out))  # fmt: skip
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("clases" if mistake == "schema typo" else "classes=None") in err
    assert not out.exists()
    code, shown, _ = _cli(capsys, "budget", "show", "--json")
    assert code == 0 and json.loads(shown)["datasets"] == []  # no run, not even a dataset recorded


def test_a_stopped_run_keeps_its_plan_and_one_copy_of_its_folder_resumes_it_under_one_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.federated.run as run
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve
    from veil.federated.settings import FederatedSettings

    class Dying(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and len([m for m in self.sent if m]) >= 1:
                raise KeyboardInterrupt  # the server is stopped in its second round
            return super().send_and_receive(messages, timeout=timeout)

    grids = iter([Dying, InProcessGrid])
    monkeypatch.setattr(
        run, "run_simulation_engine", lambda s, cpus=2: serve(next(grids)(make_client_app(s), s.clients), s)
    )
    s = FederatedSettings(mode="client-level", dataset="digits", clients=3, rounds=3, epsilon=8.0, delta=1e-3,
                          model="logreg", seed=1, out=str(tmp_path / "fl"))  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        run.simulate(s)
    status = _show(capsys, "digits")
    (first,) = status["runs"]
    sigma = json.loads((tmp_path / "fl" / "ledger.jsonl").read_text().splitlines()[0])["settings"]["sigma"]
    # The server stopped in round 2: the stop may depend on the data (revD's F7), so the whole plan of
    # three rounds stays charged rather than the two the ledger holds.
    two = _pld([dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(sigma / 2), 2)], 1e-3)
    three = _pld([dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(sigma / 2), 3)], 1e-3)
    assert first["status"] == "committed" and first["epsilon"] == pytest.approx(three, rel=0.01) != two
    shutil.copytree(tmp_path / "fl", tmp_path / "fl-copy")  # a copy of the stopped folder (revD's F1)
    report = run.simulate(s, resume=True)
    assert report["guarantee"]["rounds_charged"] == 3
    (again,) = _show(capsys, "digits")["runs"]
    assert again["run_id"] == first["run_id"] and again["status"] == "committed"
    assert again["epsilon"] == pytest.approx(three, rel=0.01)
    # The copy would train the same data again for the same record: refused, the record unchanged.
    with pytest.raises(RegistryError, match="another copy of this run folder"):
        run.simulate(s.replace(out=str(tmp_path / "fl-copy")), resume=True)
    assert _show(capsys, "digits")["runs"] == [again]
    assert not (tmp_path / "fl-copy" / "model.npz").exists()
