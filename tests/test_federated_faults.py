"""Bad inputs and faults of ``veil federated``: one-line errors (exit 2), nothing written on a refusal,
conservative accounting when clients or the server fail, and resume."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.cli.main import main
from veil.errors import DataError, VeilError
from veil.federated.apps import make_client_app
from veil.federated.partition import parse_partition, row_positions, split_rows
from veil.federated.report import build_report
from veil.federated.server import serve
from veil.federated.settings import FederatedRunError, FederatedSettings


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["federated", *args])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--clients", "5", "--clients-per-round", "6"], "clients_per_round=6"),
        (["--partition", "column:hospital"], "partition='column:hospital'"),
        (["--partition", "dirichlet:-1"], "Dirichlet"),
        (["--client-sampling-rate", "0.5", "--clients-per-round", "2"], "exactly one"),
        (["--mode", "record-level", "--clients-per-round", "2"], "record-level silos"),
        (["--clients", "10", "--delta", "0.2"], "delta=0.2"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, args, needle):
    out = tmp_path / "run"
    code, err = _cli(capsys, *args, "--out", str(out))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("veil: error: ") and needle in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_column_partition_hashes_each_value_to_a_declared_client_and_a_missing_column_is_refused():
    """``column:NAME``: a row's client is its value's keyed hash mod the declared ``--clients``, a
    function of the record alone — never the number of distinct values, which is read from the data
    (issue 23, item 7): equal values share a client, a client may be empty, no count is refused."""
    import numpy as np

    values = np.array([3, 1, 3, 2, 1, 3, 7, 7, 5])
    for clients in (1, 2, 4, 9, 20):  # fewer, as many as, and more clients than the 5 distinct values
        parts = split_rows(parse_partition("column:site"), np.zeros(9), clients, seed=0, column_values=values)
        assert len(parts) == clients
        assert sorted(np.concatenate(parts).tolist()) == list(range(9))  # every row in exactly one client
        owner = {int(i): k for k, p in enumerate(parts) for i in p}
        for v in np.unique(values):
            assert len({owner[int(i)] for i in np.flatnonzero(values == v)}) == 1  # a value, one client
        # Record-local: the rows of a value land where they land without the other values' rows.
        alone = split_rows(
            parse_partition("column:site"), np.zeros(2), clients, seed=0, column_values=values[values == 7]
        )
        assert [len(p) for p in alone] == [int(np.isin(np.flatnonzero(values == 7), p).sum()) for p in parts]
    spread = split_rows(
        parse_partition("column:site"), np.zeros(200), 4, seed=0, column_values=np.arange(200.0)
    )
    assert all(len(p) > 20 for p in spread)  # the hash spreads many values over every client
    with pytest.raises(DataError, match="no column named 'site'"):
        split_rows(parse_partition("column:site"), np.zeros(6), 3, seed=0, column_values=None)


def test_a_column_partition_with_a_value_count_other_than_clients_runs(tmp_path):
    """No refusal after reading: a column with hundreds of values over 5 declared clients gives 5."""
    from veil.federated.local import federation

    s = FederatedSettings(mode="client-level", dataset="breast-cancer", clients=5, rounds=1, epsilon=8.0,
                          delta=1e-3, sampling_rate=1.0, sigma=1.5, seed=0, out=str(tmp_path / "run"),
                          partition="column:mean radius", model="logreg")  # fmt: skip
    fed = federation(s)
    assert len(fed.parts) == 5 and all(len(p) > 0 for p in fed.parts)
    assert sum(len(p) for p in fed.parts) == len(fed.data.y_train)
    assert "mean radius" not in (fed.data.feature_names or [])  # the partition column is no feature


def test_an_empty_client_keeps_every_row_where_it_is():
    import numpy as np

    # Dirichlet with tiny α leaves clients empty by chance: they stay empty (a zero update, issue 23
    # item 7; moving a row to an empty client would make one row's client depend on the other rows).
    y = np.repeat(np.arange(3), 10)
    x = np.arange(30.0).reshape(30, 1)
    parts = split_rows(parse_partition("dirichlet:0.01"), y, 25, seed=1, positions=row_positions(x, y, 1))
    assert sorted(np.concatenate(parts).tolist()) == list(range(30))  # every row in one client
    assert any(len(p) == 0 for p in parts)


def _settings(tmp_path, **kw) -> FederatedSettings:
    base = dict(
        mode="client-level",
        dataset="digits",
        clients=4,
        rounds=4,
        epsilon=8.0,
        delta=1e-3,
        sampling_rate=1.0,
        sigma=1.5,
        seed=7,
        out=str(tmp_path),
        node_timeout=5.0,
        model="logreg",
    )
    base.update(kw)
    return FederatedSettings(**base)


def test_a_client_crashing_mid_round_is_left_out_and_the_round_is_still_charged(tmp_path):
    s = _settings(tmp_path, fail_client=1, fail_round=2)
    serve(InProcessGrid(make_client_app(s), s.clients), s)
    history = {h["round"]: h for h in json.loads((tmp_path / "history.json").read_text())["rounds"]}
    assert history[2]["failed"] == 1 and history[2]["replied"] == 3
    assert all(history[r]["failed"] == 0 for r in (1, 3, 4))
    report = build_report(tmp_path)
    assert report["guarantee"]["rounds_charged"] == 4 and report["finished"]


def test_clients_failing_every_round_stop_the_run_cleanly(tmp_path):
    s = _settings(tmp_path, clients=1, fail_client=0, fail_round=1, rounds=6)
    app = make_client_app(s.replace(fail_round=-5))

    def always_failing(msg, context):
        raise RuntimeError("disk on fire")

    with pytest.raises(FederatedRunError, match="every contacted client failed in 3 consecutive rounds"):
        serve(InProcessGrid(always_failing, 1), s)  # type: ignore[arg-type]
    assert "disk on fire" in (tmp_path / "error.txt").read_text()
    assert build_report(tmp_path)["guarantee"]["rounds_charged"] == 3  # charged, never more than run
    del app


class _DyingGrid(InProcessGrid):
    """The server's transport breaks after ``rounds_ok`` training rounds (a crash mid-run)."""

    def __init__(self, app, n, rounds_ok):
        super().__init__(app, n)
        self.rounds_ok = rounds_ok

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and len([m for m in self.sent if m]) >= self.rounds_ok:
            raise KeyboardInterrupt  # the server process is stopped mid-round
        return super().send_and_receive(messages, timeout=timeout)


def test_a_stopped_server_resumes_without_charging_a_round_twice(tmp_path):
    s = _settings(tmp_path, rounds=4)
    with pytest.raises(KeyboardInterrupt):
        serve(_DyingGrid(make_client_app(s), s.clients, rounds_ok=2), s)
    partial = build_report(tmp_path)
    assert partial["guarantee"]["rounds_charged"] == 3  # round 3 was charged before its messages left
    assert not partial["finished"] and not partial["release_ready"]
    serve(InProcessGrid(make_client_app(s), s.clients), s)  # resume: the same folder
    report = build_report(tmp_path)
    assert report["guarantee"]["rounds_charged"] == 4 and report["finished"]
    rounds = [
        r["round"]
        for r in map(json.loads, (tmp_path / "ledger.jsonl").read_text().splitlines())
        if r["kind"] == "step"
    ]
    assert rounds == [1, 2, 3, 4]


def test_the_run_folder_is_locked_against_a_second_server(tmp_path):
    from veil.accounting.ledger import RunLock

    s = _settings(tmp_path)
    with RunLock(tmp_path), pytest.raises(VeilError, match="another veil process"):
        serve(InProcessGrid(make_client_app(s), s.clients), s)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_a_resumed_research_run_draws_new_noise_not_a_replay(tmp_path):
    from veil.federated.server import _sources

    s = _settings(tmp_path)
    first = [src.standard_normal(4) for src in _sources(s, 0)]
    again = [src.standard_normal(4) for src in _sources(s, 0)]
    resumed = [src.standard_normal(4) for src in _sources(s, 2)]
    for a, b, c in zip(first, again, resumed, strict=True):
        assert (a == b).all() and not (a == c).any()
