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
    a = p.parse_args()
    torch.set_num_threads(1)
    s = FederatedSettings(mode="client-level", dataset="fashion-mnist", clients=a.clients, rounds=a.rounds,
                          epsilon=a.epsilon, delta=1e-5, sampling_rate=a.sampling_rate,
                          partition=f"dirichlet:{a.alpha:g}", model=a.model, clip=a.clip,
                          server_lr=a.server_lr, server_optimizer=a.server_optimizer,
                          server_momentum=a.server_momentum, local_epochs=a.local_epochs,
                          local_lr=a.local_lr, local_batch=a.local_batch, seed=a.seed)  # fmt: skip
    sigma = client_level_sigma(s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients)
    x_tr, y_tr, x_te, y_te, parts = _features(s, Path(a.cache))
    _, head = local.build_network(s, local.federation(s).data)
    w = [x.astype(np.float64) for x in local.get_arrays(head)]
    shapes = [x.shape for x in w]
    state = init_state(s.server_optimizer, shapes)  # type: ignore[arg-type]
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
            local.set_arrays(head, [x.astype(np.float32) for x in w])
            history.append((r, round(local.evaluate(head, x_te, y_te)[0], 4)))
            print(history[-1], flush=True)
    print(json.dumps({"settings": vars(a), "sigma": sigma, "test_accuracy": history[-1][1],
                      "accuracy_every_10_rounds": history,
                      "median_update_norm (not released, for reading only)": float(np.median(norms_seen)),
                      "wall_s": round(time.monotonic() - start),
                      "load_average": os.getloadavg()}))  # fmt: skip


if __name__ == "__main__":
    main()
