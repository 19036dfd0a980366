"""Federated DP benchmarks on Fashion-MNIST (Flower's simulation engine, real veil apps).

* ``--part client-level``: DP-FedAvg over 1,000 clients (Dirichlet α = 0.5 over labels), client-level
  ε = 3; goal test accuracy ≥ 0.80.
* ``--part record-level``: 5 IID silos each running veil's DP-SGD, record-level ε = 3 (parallel
  composition), against a central ``veil train`` with the same model at the same ε; goal within 3
  points.

Prints one JSON object (machine, load, settings, figures, wall time) per part; ``--out`` keeps the
run folders. Test accuracies are non-private figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_description


def _client_settings(args: argparse.Namespace, out: Path) -> Any:
    from veil.federated.settings import FederatedSettings

    return FederatedSettings(
        mode="client-level",
        dataset="fashion-mnist",
        clients=args.clients,
        rounds=args.rounds,
        epsilon=args.epsilon,
        delta=args.delta,
        sampling_rate=args.sampling_rate,
        partition=f"dirichlet:{args.alpha:g}",
        model=args.model,
        clip=args.clip,
        server_lr=args.server_lr,
        server_optimizer=args.server_optimizer,
        server_momentum=args.server_momentum,
        local_epochs=args.local_epochs,
        local_lr=args.local_lr,
        local_batch=args.local_batch,
        seed=args.seed,
        out=str(out),
    )


def client_level(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from veil.federated.run import simulate

    s = _client_settings(args, out / "client-level")
    start = time.monotonic()
    report = simulate(s, cpus=args.cpus)
    return {
        "part": "client-level",
        "settings": {
            k: v for k, v in s.to_run_config().items() if k not in ("out", "fail_client", "fail_round")
        },
        "sigma": report["plan"]["noise_multiplier"],
        "epsilon_spent": report["guarantee"]["epsilon_spent"],
        "test_accuracy": report["non_private"]["final_test_accuracy"],
        "best_round_accuracy (not released, for reading only)": max(
            h["test_accuracy"] for h in report["non_private"]["per_round"] if h["test_accuracy"] is not None
        ),
        "wall_s": round(time.monotonic() - start, 1),
    }


def record_level(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import veil
    from veil.federated.run import simulate
    from veil.federated.settings import FederatedSettings

    s = FederatedSettings(
        mode="record-level",
        dataset="fashion-mnist",
        clients=args.silos,
        rounds=args.silo_rounds,
        epsilon=args.epsilon,
        delta=args.delta,
        partition="iid",
        model=args.record_model,
        clip=args.record_clip,
        local_lr=args.record_lr,
        local_batch=args.record_batch,
        local_steps=args.local_steps,
        seed=args.seed,
        out=str(out / "record-level"),
    )
    start = time.monotonic()
    report = simulate(s, cpus=args.cpus)
    fed_wall = time.monotonic() - start
    start = time.monotonic()
    central = veil.train(
        {
            "dataset": "fashion-mnist",
            "model": args.record_model,
            "epsilon": args.epsilon,
            "delta": args.delta,
            "seed": max(args.seed, 0),
            "out": str(out / "central"),
        },
        progress=False,
    )
    g = report["guarantee"]
    fed_acc = report["non_private"]["final_test_accuracy"]
    return {
        "part": "record-level",
        "settings": {
            k: v
            for k, v in s.to_run_config().items()
            if k not in ("out", "fail_client", "fail_round", "sigma")
        },
        "silos": {
            k: {
                "rows": v["rows"],
                "q": v["sampling_rate"],
                "sigma": v["noise_multiplier"],
                "epsilon": v["epsilon"],
            }
            for k, v in g["silos"].items()
        },
        "epsilon_spent (max over silos)": g["epsilon_spent"],
        "federated_test_accuracy": fed_acc,
        "central_veil_train_test_accuracy": central.test_accuracy,
        "central_epsilon_spent": central.epsilon_spent,
        "central_settings": {
            "model": central.model,
            "sigma": central.noise_multiplier,
            "q": central.sampling_rate,
            "steps": central.steps,
            "C": central.max_grad_norm,
            "lr": central.lr,
        },
        "gap_points": round(100 * (central.test_accuracy - fed_acc), 2),
        "federated_wall_s": round(fed_wall, 1),
        "central_wall_s": round(time.monotonic() - start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["client-level", "record-level", "both"], default="both")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--model", default="auto", help="auto: the scattering front on Fashion-MNIST")
    p.add_argument("--seed", type=int, default=0, help="research seed (-1: secure randomness)")
    p.add_argument("--cpus", type=int, default=2, help="Ray CPUs (simulated clients in parallel)")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--sampling-rate", type=float, default=0.3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--server-optimizer", default="sgd")
    p.add_argument("--server-momentum", type=float, default=0.9)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--local-lr", type=float, default=0.05)
    p.add_argument("--local-batch", type=int, default=16)
    p.add_argument("--silos", type=int, default=5)
    p.add_argument("--silo-rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=50)
    p.add_argument("--record-batch", type=int, default=512)
    p.add_argument("--record-model", default="rff")
    p.add_argument("--record-clip", type=float, default=1.0)
    p.add_argument("--record-lr", type=float, default=2.0)
    p.add_argument("--out", default="", help="keep the run folders here (default: a temporary folder)")
    args = p.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="veil-bench-federated-"))
    results: dict[str, Any] = {"machine": machine_description(), "command": " ".join(sys.argv)}
    if args.part in ("client-level", "both"):
        results["client_level"] = client_level(args, out)
        print(json.dumps(results["client_level"]), flush=True)
    if args.part in ("record-level", "both"):
        results["record_level"] = record_level(args, out)
        print(json.dumps(results["record_level"]), flush=True)
    results["machine"]["load average at the end (1, 5, 15 min)"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
