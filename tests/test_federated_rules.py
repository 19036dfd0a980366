"""Federated runs never halt on the data once it is read (issue 23, item 7): an empty client contributes
a zero update, a silo smaller than its batch trains with fewer rows, a non-finite client update is a
failed client (zero update), not a stop."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.federated.aggregate import noisy_clipped_sum
from veil.federated.settings import FederatedSettings
from veil.mechanisms.rng import make_source


def test_a_non_finite_update_adds_nothing_and_is_reported_as_failed() -> None:
    good = [np.array([3.0, 4.0])]
    bad = [np.array([np.nan, 1.0])]
    total, norms = noisy_clipped_sum(
        [good, bad, good], [(2,)], clip=1.0, sigma=0.0, source=make_source(False, 0)
    )
    np.testing.assert_allclose(total[0], 2 * np.array([0.6, 0.8]))  # the two clipped good updates only
    assert math.isnan(norms[1]) and norms[0] == norms[2] == 5.0


def test_a_client_sending_nan_is_a_failed_client_and_the_run_goes_on(tmp_path) -> None:
    from veil.federated.apps import make_client_app
    from veil.federated.report import build_report
    from veil.federated.server import serve

    s = FederatedSettings(mode="client-level", dataset="digits", clients=3, rounds=3, epsilon=8.0, delta=1e-3,
                          sampling_rate=1.0, sigma=1.5, seed=7, out=str(tmp_path), node_timeout=5.0,
                          model="logreg")  # fmt: skip
    inner = make_client_app(s)

    def client(msg, context):  # partition 0 diverges in round 2
        reply = inner(msg, context)
        if int(context.node_config["partition-id"]) == 0 and int(msg.content["config"]["server-round"]) == 2:
            arrays = reply.content["arrays"].to_numpy_ndarrays()
            arrays[0][...] = np.nan
            from flwr.app import ArrayRecord

            reply.content["arrays"] = ArrayRecord(arrays)
        return reply

    serve(InProcessGrid(client, s.clients), s)  # type: ignore[arg-type]
    history = {h["round"]: h for h in json.loads((tmp_path / "history.json").read_text())["rounds"]}
    assert history[2]["failed"] == 1 and history[3]["failed"] == 0
    report = build_report(tmp_path)
    assert report["guarantee"]["rounds_charged"] == 3 and report["finished"]
    with np.load(tmp_path / "model.npz") as z:
        assert all(np.isfinite(z[k]).all() for k in z.files)


def test_an_empty_client_is_a_zero_update_not_a_refusal() -> None:
    from veil.federated import local

    s = FederatedSettings(mode="client-level", dataset="digits", clients=30, rounds=1, epsilon=8.0,
                          delta=1e-3, sampling_rate=1.0, sigma=1.5, seed=1, partition="dirichlet:0.01",
                          model="logreg")  # fmt: skip
    fed = local.federation(s)  # tiny α leaves clients empty: no refusal after the rows are read
    empty = [k for k, rows in enumerate(fed.parts) if len(rows) == 0]
    assert empty and sum(len(p) for p in fed.parts) == fed.data.n_train
    front, head = local.build_network(s, fed.data)
    before = local.get_arrays(head)
    x, y = local.partition_features(s, empty[0], front)
    local.local_sgd(head, x, y, s, seed=0)
    for a, b in zip(before, local.get_arrays(head), strict=True):
        np.testing.assert_array_equal(a, b)  # its update is zero


def test_a_silo_smaller_than_its_batch_trains_with_fewer_rows() -> None:
    import torch

    from veil.federated import local
    from veil.federated.charge import silo_plan

    s = FederatedSettings(mode="record-level", dataset="digits", clients=2, rounds=1, epsilon=8.0, delta=1e-4,
                          seed=1, local_batch=32, local_steps=3, model="logreg")  # fmt: skip
    assert local.silo_sampling_rate(s, 5) == 1.0 and silo_plan(s, 5)[0] == 1.0
    assert local.silo_sampling_rate(s, 0) == 1.0 and silo_plan(s, 0)[0] == 1.0
    head = torch.nn.Linear(4, 2)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1])
    assert local.local_dpsgd(head, x, y, s, sigma=1.0, seed=3) == 3
    assert local.local_dpsgd(head, x[:0], y[:0], s, sigma=1.0, seed=3) == 3  # no rows: no update
