"""Federated DP benchmarks on Fashion-MNIST (Flower's simulation engine, real veil apps).

* ``--part client-level``: DP-FedAvg over 1,000 clients (Dirichlet α = 0.5 over labels), client-level
  ε = 3; goal test accuracy ≥ 0.80.
* ``--part flower``: the same client-level federation (partition, clients, local training, C, rounds)
  under Flower's own ``DifferentialPrivacyServerSideFixedClipping`` around ``FedAvg``: a fixed-size
  sample of qN clients without replacement each round, server-side clipping, noise σC/(qN) on the
  mean. Flower's accountant (``flwr.serverapp.RdpAccountant``) is accepted by that wrapper only with
  no sampling amplification; its ε is reported beside veil's PLD ε of the same σ and rounds, with
  the amplification veil's Poisson sampling earns at the same q (Flower's fixed-size sample without
  replacement is not the Poisson sampling that veil accounts; at q = 1 the two are one mechanism).
  By default σ is the one veil calibrated for its own run, so both add the same noise.
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

_SHOWN = ("clients", "rounds", "epsilon", "delta", "sampling_rate", "partition", "model", "clip",
           "server_lr", "server_momentum", "local_epochs", "local_lr", "local_batch", "seed")  # fmt: skip


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


def flower_dp_fixed_clipping(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` on veil's ClientApp, same data."""
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp import (
        Grid,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
        ServerApp,
    )
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation

    from veil.federated import local
    from veil.federated.apps import make_client_app
    from veil.federated.privacy import client_level_epsilon, client_level_sigma, round_event

    s = _client_settings(args, out / "flower")
    sampled = max(1, round(s.sampling_rate * s.clients))
    sigma = args.flower_sigma or client_level_sigma(
        s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients, s.accountant
    )
    accountant = RdpAccountant(
        PrivacyConfig(
            target_delta=s.delta,
            population_size=s.clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=sampled / s.clients, fraction_evaluate=0.0, min_available_nodes=s.clients),
        noise_multiplier=sigma,
        clipping_norm=s.clip,
        num_sampled_clients=sampled,
        accountant=accountant,
    )
    fed = local.federation(s)
    front, head = local.build_network(s, fed.data)
    x_test, y_test = local.client_features(s, None, front, test=True)
    history: list[dict[str, float]] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        local.set_arrays(head, arrays.to_numpy_ndarrays())
        acc, _ = local.evaluate(head, x_test, y_test)
        history.append({"round": server_round, "test_accuracy": acc})
        return MetricRecord({"accuracy": acc})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Any) -> None:
        strategy.start(
            grid,
            ArrayRecord(local.get_arrays(head)),
            num_rounds=s.rounds,
            timeout=s.node_timeout,
            evaluate_fn=evaluate,
        )

    backend = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": args.cpus, "num_gpus": 0, "log_to_driver": False, "logging_level": "error"},
    }
    start = time.monotonic()
    run_simulation(server, make_client_app(s), num_supernodes=s.clients, backend_config=backend)
    spent = accountant.get_privacy_spent()
    poisson_eps = client_level_epsilon([round_event(s.sampling_rate, sigma)] * s.rounds, s.delta)
    return {
        "part": "flower DifferentialPrivacyServerSideFixedClipping(FedAvg)",
        "settings": {k: v for k, v in s.to_run_config().items() if k in _SHOWN},
        "sigma": sigma,
        "clients_per_round (fixed, without replacement)": sampled,
        "epsilon_flower_rdp_no_amplification": spent.epsilon,
        "flower_releases_accounted": spent.num_releases,
        "epsilon_veil_pld_same_sigma_if_poisson_q": poisson_eps,
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
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
    p.add_argument("--part", choices=["client-level", "flower", "record-level", "both"], default="both")
    p.add_argument(
        "--flower-sigma", type=float, default=0.0, help="Flower's σ (default: veil's calibrated σ)"
    )
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
    if args.part == "flower":
        results["flower"] = flower_dp_fixed_clipping(args, out)
        print(json.dumps(results["flower"]), flush=True)
    if args.part in ("record-level", "both"):
        results["record_level"] = record_level(args, out)
        print(json.dumps(results["record_level"]), flush=True)
    results["machine"]["load average at the end (1, 5, 15 min)"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
