"""The server's step on the noisy mean (FedAvgM, FedAdam): against torch's own optimizers, saved with
the checkpoint, and post-processing (the charged events do not depend on it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from veil.errors import ConfigError
from veil.federated.server_optimizer import init_state, server_step


def _reference(name: str, w0: list[np.ndarray], updates: list[list[np.ndarray]], lr: float, beta: float):
    """torch.optim on the loss whose gradient is −g (the server ascends along the mean update)."""
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in w0]
    opt: torch.optim.Optimizer
    if name == "momentum":
        opt = torch.optim.SGD(params, lr=lr, momentum=beta, dampening=0.0)
    else:
        opt = torch.optim.Adam(params, lr=lr, betas=(beta, 0.99), eps=1e-3)
    for g in updates:
        for p, gi in zip(params, g, strict=True):
            p.grad = -torch.tensor(gi, dtype=torch.float64)
        opt.step()
    return [p.detach().numpy() for p in params]


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_server_steps_match_torch_optimizers(name: str) -> None:
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4,)]
    w0 = [rng.normal(size=s) for s in shapes]
    updates = [[rng.normal(size=s) for s in shapes] for _ in range(5)]
    w, state = [a.copy() for a in w0], init_state(name, shapes)  # type: ignore[arg-type]
    for g in updates:
        w, state = server_step(name, w, g, state, lr=0.3, momentum=0.8)  # type: ignore[arg-type]
    for ours, ref in zip(w, _reference(name, w0, updates, 0.3, 0.8), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)


def test_plain_sgd_is_the_fedavg_step() -> None:
    w, g = [np.ones(3)], [np.array([0.5, -1.0, 2.0])]
    out, state = server_step("sgd", w, g, init_state("sgd", [(3,)]), lr=2.0, momentum=0.9)
    np.testing.assert_allclose(out[0], [2.0, -1.0, 5.0])
    assert state == {}


@pytest.mark.parametrize(("kw", "needle"), [({"server_optimizer": "nesterov"}, "server_optimizer"),
                                            ({"server_momentum": 1.0}, "server_momentum")])  # fmt: skip
def test_an_unknown_step_or_a_momentum_of_one_is_refused(kw, needle) -> None:
    from veil.federated.settings import FederatedSettings

    with pytest.raises(ConfigError, match=needle):
        FederatedSettings(mode="client-level", dataset="digits", clients=3, rounds=1, epsilon=1.0, delta=1e-3,
                          **kw)  # fmt: skip


def test_the_server_step_is_post_processing_and_its_moments_are_checkpointed(tmp_path) -> None:
    """Same seed, same data: the ledgers of an sgd and an adam run charge the same events; the adam
    checkpoint carries its moments, which a resumed server reads back."""
    pytest.importorskip("flwr")
    from _fake_grid import InProcessGrid
    from veil.federated.apps import make_client_app
    from veil.federated.server import _load_checkpoint, serve
    from veil.federated.settings import FederatedSettings

    events = {}
    for name in ("sgd", "adam"):
        out = tmp_path / name
        out.mkdir()
        s = FederatedSettings(mode="client-level", dataset="digits", clients=4, rounds=2, epsilon=8.0,
                              delta=1e-3, sampling_rate=0.5, sigma=1.5, seed=3, out=str(out),
                              node_timeout=5.0, model="logreg", server_optimizer=name,
                              server_lr=0.05)  # fmt: skip
        serve(InProcessGrid(make_client_app(s), s.clients), s)  # type: ignore[arg-type]
        records = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()[1:]]
        events[name] = [(r["round"], r["event"], r["sampled"]) for r in records if r["kind"] == "step"]
        saved = _load_checkpoint(out / "checkpoint.npz")
        assert saved is not None and saved[1] == 2
        assert (saved[2] == {}) == (name == "sgd")
        if name == "adam":
            assert float(saved[2]["t"]) == 2.0 and {"m_0", "v_0", "m_1", "v_1"} <= set(saved[2])
    assert events["sgd"] == events["adam"] and len(events["sgd"]) == 2


def test_the_step_reads_the_clipped_sum_over_the_public_count_qn() -> None:
    """σ = 0 makes the release exact: every client sends Δ = (3, 4, 0), clipped to C = 1 → (0.6, 0.8, 0);
    the mean is the sum over qN = 2 (never over the realised count), then momentum: m₂ = β·m₁ + g₂."""
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

    from _fake_grid import InProcessGrid
    from veil.federated.strategy import PoissonDPFedAvg
    from veil.mechanisms.rng import make_source

    def client(msg: Message, context: object) -> Message:
        sent = msg.content["arrays"].to_numpy_ndarrays()
        return Message(
            RecordDict({"arrays": ArrayRecord([sent[0] + np.array([3.0, 4.0, 0.0])])}), reply_to=msg
        )

    sampled: list[int] = []
    strategy = PoissonDPFedAvg(
        sampling_rate=0.5, clip=1.0, noise_multiplier=0.0, expected_clients=2.0, server_lr=0.5,
        sampling_source=make_source(False, 11), noise_source=make_source(False, 12),
        charge=lambda r, nodes: sampled.append(len(nodes)), server_optimizer="momentum", server_momentum=0.9,
    )  # fmt: skip
    grid = InProcessGrid(client, 4)  # type: ignore[arg-type]
    w = [np.zeros(3)]
    means = []
    for r in (1, 2):
        messages = list(strategy.configure_train(r, ArrayRecord(w), ConfigRecord(), grid))
        record, _ = strategy.aggregate_train(r, grid.send_and_receive(messages))
        assert record is not None
        w = record.to_numpy_ndarrays()
        means.append(sampled[-1] * np.array([0.6, 0.8, 0.0]) / 2.0)
    assert sampled != [2, 2]  # the seed gives a realised count other than qN in some round
    np.testing.assert_allclose(w[0], 0.5 * means[0] + 0.5 * (0.9 * means[0] + means[1]), rtol=1e-6)
