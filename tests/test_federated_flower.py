"""veil's federated apps on Flower's real runtimes: the simulation engine (Ray) through ``veil
federated``, and separate processes (a SuperLink and two SuperNodes on loopback, started here, driven
with ``flwr run``). Both produce a report. Slow by nature (process and Ray start-up): one of each."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from veil.cli.main import main


def test_simulation_engine_run_through_the_command_produces_a_report(tmp_path, capsys):
    out = tmp_path / "sim"
    code = main(
        [
            "federated",
            "--dataset",
            "digits",
            "--model",
            "logreg",
            "--clients",
            "3",
            "--rounds",
            "2",
            "--epsilon",
            "8",
            "--delta",
            "1e-3",
            "--seed",
            "1",
            "--out",
            str(out),
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    report = json.loads(captured.out.strip().splitlines()[-1])
    g = report["guarantee"]
    assert g["mode"] == "client-level" and g["rounds_charged"] == 2
    assert 0 < g["epsilon_spent"] <= 8
    assert g["flower_rdp_epsilon"] >= g["epsilon_spent"]  # q = 1: Flower's accountant beside veil's
    assert report["non_private"]["final_test_accuracy"] is not None
    assert [h["replied"] for h in report["non_private"]["per_round"][1:]] == [3, 3]
    assert (out / "report.html").read_text().count("Flower") >= 1
    assert json.loads((out / "report.json").read_text())["guarantee"] == g


def test_superlink_and_two_supernodes_on_loopback_driven_by_flwr_run(tmp_path):
    from veil.federated.deploy import local_deployment
    from veil.federated.run import plan, raise_if_failed, report_files
    from veil.federated.settings import FederatedSettings

    s = plan(
        FederatedSettings(
            mode="record-level",
            dataset="digits",
            model="logreg",
            clients=2,
            rounds=1,
            epsilon=4.0,
            delta=1e-4,
            local_steps=3,
            local_batch=32,
            seed=2,
            out=str(tmp_path / "run"),
            node_timeout=60.0,
        )
    )
    (tmp_path / "run").mkdir()
    done = local_deployment(s, tmp_path / "work", timeout=150)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    raise_if_failed(tmp_path / "run")
    report = report_files(tmp_path / "run", None)
    g = report["guarantee"]
    assert sorted(g["silos"]) == ["silo-0", "silo-1"]
    assert g["epsilon_spent"] == max(v["epsilon"] for v in g["silos"].values())
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    assert (tmp_path / "run" / "report.html").exists()
    logs = (tmp_path / "work" / "supernode-0.log").read_text() + (
        tmp_path / "work" / "superlink.log"
    ).read_text()
    assert logs  # the processes ran and logged; all were stopped by local_deployment
