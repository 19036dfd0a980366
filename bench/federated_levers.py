"""Client-level DP-FedAvg levers on Fashion-MNIST, replayed in one process (no Flower), to find them fast.

The rounds use veil's own pieces — the partition (:func:`veil.federated.local.federation`), Poisson
client sampling (:func:`veil.federated.strategy.poisson_sample`), local SGD
(:func:`veil.federated.local.local_sgd`), clipping and noise
(:func:`veil.federated.aggregate.noisy_clipped_sum`),
σ from :func:`veil.federated.privacy.client_level_sigma`, the server step
(:func:`veil.federated.server_optimizer.server_step`) — on features of the fixed front computed once
(cached under ``--cache``). Only Flower's messaging is left out, so one run takes minutes where the
simulation engine takes tens; confirm a setting with ``bench/federated.py`` (the real apps on Flower).

    python bench/federated_levers.py --model scatternet --clip 0.5
    python bench/federated_levers.py --model logreg --sampling-rate 1 --rounds 20
    python bench/federated_levers.py --flower     # Flower's DifferentialPrivacyServerSideFixedClipping

``--flower`` drives Flower's own ``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` (its sampling:
a fixed-size sample of qN clients without replacement; its clipping, FedAvg and noise σC/(qN) on the
mean; its RDP accountant, which that wrapper accepts only without sampling amplification) on the same
partition, local training and σ, with the same in-process client step in place of Flower's messaging.

Seeded (research) randomness; test accuracy on the 10,000 official test images is a non-private figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


def _features(s, cache: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    from veil.federated import local
    from veil.models import fixed_features

    fed = local.federation(s)
    front, _ = local.build_network(s, fed.data)
    data = fed.data
    if front is None:
        x_tr, x_te = np.asarray(data.x_train, np.float32), np.asarray(data.x_test, np.float32)
    else:
        path = cache / f"{data.sha256[:12]}-{s.model}.npz"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, tr=fixed_features(front, data.x_train), te=fixed_features(front, data.x_test))
        with np.load(path) as z:
            x_tr, x_te = z["tr"], z["te"]
    y_tr = torch.from_numpy(np.asarray(data.y_train, np.int64))
    y_te = torch.from_numpy(np.asarray(data.y_test, np.int64))
    return torch.from_numpy(x_tr), y_tr, torch.from_numpy(x_te), y_te, list(fed.parts)


class _Nodes:
    """The one thing Flower's strategies ask a grid before sending: the connected node ids (1..N)."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(1, n + 1))

    def get_node_ids(self) -> list[int]:
        return self.ids


def _flower_rounds(s, sigma, x_tr, y_tr, parts, head, w, evaluate, seed) -> tuple[list, dict]:
    """Flower's DP wrapper, round by round; each sampled client trains as veil's ClientApp does."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from veil.federated import local

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a ServerApp process sets

    m = round(s.sampling_rate * s.clients)
    accountant = RdpAccountant(PrivacyConfig(target_delta=s.delta, population_size=s.clients,
                                             neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                             sampling_method=SamplingMethod.NO_AMPLIFICATION))  # fmt: skip
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=m / s.clients, fraction_evaluate=0.0, min_available_nodes=s.clients),
        noise_multiplier=sigma, clipping_norm=s.clip, num_sampled_clients=m, accountant=accountant,
    )  # fmt: skip
    grid, arrays, history = _Nodes(s.clients), ArrayRecord([x.astype(np.float32) for x in w]), []
    for r in range(1, s.rounds + 1):
        replies = []
        for msg in strategy.configure_train(r, arrays, ConfigRecord(), grid):  # type: ignore[arg-type]
            k = int(msg.metadata.dst_node_id) - 1
            local.set_arrays(head, msg.content["arrays"].to_numpy_ndarrays())
            local.local_sgd(head, x_tr[parts[k]], y_tr[parts[k]], s, seed * 100_003 + r * 1009 + k)
            msg.metadata.__dict__["_src_node_id"] = 0
            content = {
                "arrays": ArrayRecord(local.get_arrays(head)),
                "metrics": MetricRecord({"num-examples": 1}),
            }
            replies.append(Message(RecordDict(content), reply_to=msg))
        new, _ = strategy.aggregate_train(r, replies)
        arrays = new if new is not None else arrays
        if r % 10 == 0 or r == s.rounds:
            history.append((r, evaluate(arrays.to_numpy_ndarrays())))
            print(history[-1], flush=True)
    spent = accountant.get_privacy_spent()
    return history, {"epsilon_flower_rdp_no_amplification": spent.epsilon, "releases": spent.num_releases,
                     "clients_per_round (fixed, without replacement)": m}  # fmt: skip


def main() -> None:
    from veil.federated import local
    from veil.federated.aggregate import noisy_clipped_sum
    from veil.federated.privacy import client_level_sigma
    from veil.federated.server_optimizer import init_state, server_step
    from veil.federated.settings import FederatedSettings
    from veil.federated.strategy import poisson_sample
    from veil.mechanisms.rng import make_source

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="scatternet")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--sampling-rate", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--server-optimizer", default="sgd")
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--server-momentum", type=float, default=0.9)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--local-lr", type=float, default=0.05)
    p.add_argument("--local-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="runs/bench-federated-levers")
    p.add_argument("--flower", action="store_true", help="Flower's DP wrapper instead of veil's rounds")
    p.add_argument("--sigma", type=float, default=0.0, help="σ (default: veil's calibration for ε)")
    a = p.parse_args()
    torch.set_num_threads(1)
    s = FederatedSettings(mode="client-level", dataset="fashion-mnist", clients=a.clients, rounds=a.rounds,
                          epsilon=a.epsilon, delta=1e-5, sampling_rate=a.sampling_rate,
                          partition=f"dirichlet:{a.alpha:g}", model=a.model, clip=a.clip,
                          server_lr=a.server_lr, server_optimizer=a.server_optimizer,
                          server_momentum=a.server_momentum, local_epochs=a.local_epochs,
                          local_lr=a.local_lr, local_batch=a.local_batch, seed=a.seed)  # fmt: skip
    sigma = a.sigma or client_level_sigma(s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients)
    x_tr, y_tr, x_te, y_te, parts = _features(s, Path(a.cache))
    _, head = local.build_network(s, local.federation(s).data)
    w = [x.astype(np.float64) for x in local.get_arrays(head)]
    shapes = [x.shape for x in w]
    state = init_state(s.server_optimizer, shapes)  # type: ignore[arg-type]

    def evaluate(arrays: list[np.ndarray]) -> float:
        local.set_arrays(head, [x.astype(np.float32) for x in arrays])
        return round(local.evaluate(head, x_te, y_te)[0], 4)

    if a.flower:
        from veil.federated.privacy import client_level_epsilon, round_event

        history, flower = _flower_rounds(s, sigma, x_tr, y_tr, parts, head, w, evaluate, a.seed)
        poisson = client_level_epsilon([round_event(s.sampling_rate, sigma)] * s.rounds, s.delta)
        print(json.dumps({"settings": vars(a), "sigma": sigma, "test_accuracy": history[-1][1],
                          "accuracy_every_10_rounds": history, **flower,
                          "epsilon_veil_pld_of_poisson_q_same_sigma": poisson,
                          "load_average": os.getloadavg()}))  # fmt: skip
        return
    sampling, noise = make_source(False, 2 * a.seed + 1), make_source(False, 2 * a.seed + 2)
    history, norms_seen, start = [], [], time.monotonic()
    for r in range(1, s.rounds + 1):
        deltas = []
        for k in poisson_sample(list(range(s.clients)), s.sampling_rate, sampling):
            local.set_arrays(head, [x.astype(np.float32) for x in w])
            local.local_sgd(head, x_tr[parts[k]], y_tr[parts[k]], s, a.seed * 100_003 + r * 1009 + k)
            deltas.append([n.astype(np.float64) - o for n, o in zip(local.get_arrays(head), w, strict=True)])
        total, norms = noisy_clipped_sum(deltas, shapes, s.clip, sigma, noise)
        norms_seen += norms
        mean = [t / s.expected_clients for t in total]
        w, state = server_step(s.server_optimizer, w, mean, state, s.server_lr, s.server_momentum)  # type: ignore[arg-type]
        if r % 10 == 0 or r == s.rounds:
            history.append((r, evaluate(w)))
            print(history[-1], flush=True)
    print(json.dumps({"settings": vars(a), "sigma": sigma, "test_accuracy": history[-1][1],
                      "accuracy_every_10_rounds": history,
                      "median_update_norm (not released, for reading only)": float(np.median(norms_seen)),
                      "wall_s": round(time.monotonic() - start),
                      "load_average": os.getloadavg()}))  # fmt: skip


if __name__ == "__main__":
    main()
