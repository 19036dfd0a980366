"""Clients as they come (issue 25): under Dirichlet(0.1) over 200 digits clients many clients hold no
row or one row; each is a client with nothing (or little) to add — it replies with a zero update, is
counted in the round's cohort (the fixed denominator qN assumes every sampled client), and the run
neither refuses nor halts after the rows are read. The runs go through ``veil federated`` with
Flower's simulation engine replaced by an in-process grid (same ClientApp and ServerApp code)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.cli.main import main
from veil.federated.settings import FederatedSettings


@pytest.fixture
def in_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``veil federated`` runs its ServerApp against an in-process grid of its ClientApps."""
    from veil.federated import run
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve

    def engine(s: FederatedSettings, cpus: int = 2) -> None:
        # The simulation engine logs a ServerApp failure; raise_if_failed then reads error.txt.
        with contextlib.suppress(Exception):
            serve(InProcessGrid(make_client_app(s), s.clients), s)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "run_simulation_engine", engine)


def _federated(capsys: pytest.CaptureFixture[str], out, *args: str) -> tuple[int, dict, str]:
    code = main(["federated", "--dataset", "digits", "--model", "logreg", "--epsilon", "3",
                 "--seed", "5", "--out", str(out), "--json", *args])  # fmt: skip
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1]) if code == 0 else {}
    return code, report, captured.err


def _sampled(out) -> list[int]:
    lines = (out / "ledger.jsonl").read_text().splitlines()
    return [r["sampled"] for r in map(json.loads, lines) if r.get("kind") == "step"]


def test_dirichlet_0_1_over_200_digits_clients_runs_with_empty_and_tiny_clients(
    in_process_engine, capsys, tmp_path
) -> None:
    from veil.federated.local import federation

    out = tmp_path / "run"
    code, report, err = _federated(capsys, out, "--clients", "200", "--partition", "dirichlet:0.1",
                                   "--clients-per-round", "100", "--rounds", "3")  # fmt: skip
    assert code == 0, err[-2000:]
    sizes = [len(p) for p in federation(FederatedSettings.from_run_config(
        json.loads((out / "ledger.jsonl").read_text().splitlines()[0])["settings"])).parts]  # fmt: skip
    assert sizes.count(0) >= 10 and sizes.count(1) >= 1  # the setting does hold empty and 1-row clients
    g = report["guarantee"]
    assert g["rounds_charged"] == 3 and report["finished"] and 0 < g["epsilon_spent"] <= 3
    rounds = report["non_private"]["per_round"][1:]
    # Every sampled client — empty ones included — replied and is counted; none failed.
    assert [h["replied"] for h in rounds] == _sampled(out)
    assert all(h["failed"] == 0 for h in rounds)


def test_an_empty_client_replies_the_model_it_received() -> None:
    """The zero update, through the ClientApp itself (what the server subtracts from)."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from veil.federated import local
    from veil.federated.apps import make_client_app

    s = FederatedSettings(mode="client-level", dataset="digits", clients=200, rounds=1, epsilon=3.0,
                          delta=1e-5, partition="dirichlet:0.1", model="logreg", seed=2)  # fmt: skip
    parts = local.federation(s).parts
    grid = InProcessGrid(make_client_app(s), s.clients)
    _, head = local.build_network(s, local.federation(s).data)
    sent = [a + 0.25 for a in local.get_arrays(head)]
    empty = next(k for k, p in enumerate(parts) if len(p) == 0)
    one_row = next(k for k, p in enumerate(parts) if len(p) == 1)
    for pid in (empty, one_row):
        msg = Message(RecordDict({"arrays": ArrayRecord(sent), "config": ConfigRecord({"server-round": 1})}),
                      message_type=MessageType.TRAIN, dst_node_id=101 + pid)  # fmt: skip
        (reply,) = grid.send_and_receive([msg])
        assert not reply.has_error()
        got = reply.content["arrays"].to_numpy_ndarrays()
        same = all(np.array_equal(a, b) for a, b in zip(sent, got, strict=True))
        assert same == (len(parts[pid]) == 0)  # empty: exactly the model sent; one row: it trained


def test_more_clients_than_rows_is_not_refused_after_reading(in_process_engine, capsys, tmp_path) -> None:
    """The row count is a fact of the data: a client count above it leaves clients empty, it does not
    stop the run (nor print the count)."""
    out = tmp_path / "run"
    code, report, err = _federated(capsys, out, "--clients", "1500", "--clients-per-round", "30",
                                   "--rounds", "1", "--delta", "1e-6")  # fmt: skip
    assert code == 0, err[-2000:]
    assert report["guarantee"]["rounds_charged"] == 1 and report["finished"]
    assert report["non_private"]["per_round"][1]["replied"] == _sampled(out)[0]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("client-level", (0.5, 0.05, 16)), ("record-level", (1.0, 0.1, 32))],
)
def test_the_command_s_defaults_follow_the_mode(monkeypatch, tmp_path, mode, expected) -> None:
    """C, local lr and batch mean different things in the two modes: each has its own measured default;
    a flag given overrides it."""
    from veil.federated import run

    seen: list[FederatedSettings] = []

    def capture(s: FederatedSettings, **kw: object) -> dict:
        seen.append(s)
        raise SystemExit(0)

    monkeypatch.setattr(run, "simulate", capture)
    for extra in ([], ["--clip", "2"]):
        with pytest.raises(SystemExit):
            main(["federated", "--mode", mode, "--out", str(tmp_path / "x"), *extra])
    assert (seen[0].clip, seen[0].local_lr, seen[0].local_batch) == expected
    assert seen[1].clip == 2.0
