"""Data-parallel DP-SGD throughput: 1 vs 2 processes (one thread each), veil beside Opacus.

Each configuration (library × world size × repetition) runs in fresh processes started with
``torch.multiprocessing`` (spawn) that meet through a file rendezvous and talk over gloo on CPU:

* veil, 1 process: ``PrivacyEngine.make_private`` on the plain module (what a one-process user runs);
  "veil" is the default secure engine (noise and sampling from the OS CSPRNG), "veil-seeded" research
  mode (torch's seeded generator, the kind of noise Opacus draws with ``secure_mode=False``, as here);
* veil, 2 processes: ``make_private`` on the ``DistributedDataParallel``-wrapped module (each rank
  samples its shard of every Poisson batch, one all-reduce of the clipped sums per step);
* Opacus, 1 process: its ``make_private`` on the plain module; Opacus, 2 processes: on its
  ``DPDDP``-wrapped module (its distributed Poisson sampler), where it runs; "opacus" is its default
  per-sample-gradient hooks, "opacus-ghost" its ghost clipping (``grad_sample_mode="ghost"``).

Same synthetic data (N examples, 784 features, 10 classes), same MLP (784 → 256 → tanh → 10), same
expected logical batch (B), σ and C. Every rank runs ``--warmup`` logical steps, waits at a barrier,
then times as many logical steps as fill about ``--seconds`` (estimated from the warm-up; at
least ``--steps``; the same count on every rank), and waits at a barrier again; examples/s is the number of
examples in those steps *over all ranks* divided by rank 0's wall time. The scaling ratio is the
2-process examples/s over the 1-process examples/s of the same library. Repetitions are interleaved
(rep 1 of every configuration, then rep 2, ...) so drift in the machine's load hits all alike; the
table shows medians and the load average seen during the runs. A second table runs each library once
on tiny data (8 examples, q = 0.25, 2 processes, where local batches are often empty) and says
whether it finished.

Usage::

    python bench/distributed.py              # 3 repetitions (a few minutes on 2 cores)
    python bench/distributed.py --quick      # smoke run: few steps, one repetition
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table

LIBRARIES = ("veil", "veil-seeded", "opacus", "opacus-ghost")


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 256), nn.Tanh(), nn.Linear(256, 10))


def _make_private(library: str, world: int, settings: dict[str, Any]) -> tuple[nn.Module, Any, Any, Any]:
    """``(model, optimizer, loader, criterion)`` of the library's private training."""
    model = _model()
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(_data(settings["n"]), batch_size=settings["batch"])
    common = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}
    if library.startswith("veil"):
        from veil.engine import PrivacyEngine

        module = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        # "veil": the default, noise and sampling from the OS CSPRNG; "veil-seeded": research mode,
        # torch's generator like Opacus with secure_mode=False (as run here).
        engine = PrivacyEngine(seed=0, reproducible=True) if library == "veil-seeded" else PrivacyEngine()
        private = engine.make_private(module=module, optimizer=optimizer, data_loader=loader, **common)
        return (*private, criterion)
    import opacus
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    module = DPDDP(model) if world > 1 else model
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    engine = opacus.PrivacyEngine(secure_mode=False)
    if library == "opacus-ghost":  # fast gradient clipping: the loss is wrapped, backward runs twice
        model, optimizer, criterion, loader = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=loader,
            criterion=criterion,
            grad_sample_mode="ghost",
            **common,
        )
        return model, optimizer, loader, criterion
    return (*engine.make_private(module=module, optimizer=optimizer, data_loader=loader, **common), criterion)


def _steps(model: nn.Module, optimizer: Any, loader: Any, crit: Any, count: int) -> int:
    """Run ``count`` logical steps; the number of (local) examples they held."""
    taken = examples = 0
    while taken < count:
        for x, y in loader:
            optimizer.zero_grad()
            crit(model(x), y).backward()
            optimizer.step()
            examples += len(x)
            if getattr(optimizer, "pending_chunks", 0) == 0:
                taken += 1
            if taken == count:
                break
    return examples


def _rank(rank: int, world: int, library: str, settings: dict[str, Any], rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=settings.get("collective_timeout", 300)),
    )
    try:
        model, optimizer, loader, crit = _make_private(library, world, settings)
        start = time.perf_counter()
        _steps(model, optimizer, loader, crit, settings["warmup"])
        per_step = (time.perf_counter() - start) / max(1, settings["warmup"])
        # As many steps as fill about --seconds (at least --steps), the same on every rank.
        count = torch.tensor([max(settings["steps"], math.ceil(settings["seconds"] / per_step))])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        dist.barrier()
        start = time.perf_counter()
        examples = torch.tensor([_steps(model, optimizer, loader, crit, int(count))], dtype=torch.float64)
        dist.barrier()
        seconds = time.perf_counter() - start
        dist.all_reduce(examples)
        if rank == 0:
            result = {"seconds": seconds, "examples": float(examples.item()), "steps": int(count)}
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


exit_failures: list[str] = []  # processes that failed after the timed part, at shutdown


def run_once(library: str, world: int, settings: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One configuration in fresh processes; ``{"error": ...}`` if it failed or timed out."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        load_before = os.getloadavg()[0]
        context = mp.start_processes(
            _rank,
            args=(world, library, settings, str(Path(tmp) / "rendezvous"), str(out)),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        error = None
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f} s"
                    break
        except Exception as exc:  # a rank failed: report it, keep benchmarking the others
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
            if out.exists():  # it failed after rank 0 wrote its result: at exit, not while timed
                exit_failures.append(error)
                error = None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        if error is not None or not out.exists():
            return {"error": error or "no result"}
        result = json.loads(out.read_text())
        result["examples_per_s"] = result["examples"] / result["seconds"]
        result["load"] = max(load_before, os.getloadavg()[0])
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="dataset size N")
    parser.add_argument("--batch", type=int, default=256, help="expected logical batch B = q·N")
    parser.add_argument("--steps", type=int, default=5, help="at least this many timed logical steps")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed steps fill about this long")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 repetition")
    parser.add_argument(
        "--no-tiny", dest="tiny", action="store_false", help="skip the tiny-data run (8 examples, 2 ranks)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seconds, args.warmup, args.repeats, args.n, args.batch = 2, 0.0, 1, 1, 512, 32
    settings = {"n": args.n, "batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    settings["seconds"] = args.seconds
    libraries = [name for name in args.libraries.split(",") if name]
    configs = [(library, world) for library in libraries for world in (1, 2)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        for i in range(len(configs)):
            config = configs[(i + rep) % len(configs)]
            runs[config].append(run_once(*config, settings, args.timeout))
    rows = []
    for library in libraries:
        rates: dict[int, float | None] = {}
        for world in (1, 2):
            ok = [r for r in runs[(library, world)] if "error" not in r]
            rates[world] = statistics.median(r["examples_per_s"] for r in ok) if ok else None
        for world in (1, 2):
            ok = [r for r in runs[(library, world)] if "error" not in r]
            errors = [r["error"] for r in runs[(library, world)] if "error" in r]
            rate = rates[world]
            ratio = rates[2] / rates[1] if world == 2 and rates[1] and rates[2] else None
            rows.append(
                [
                    library,
                    world,
                    f"{rate:.0f}" if rate is not None else "failed: " + (errors[0] if errors else "?"),
                    f"{ratio:.2f}×" if ratio is not None else "",
                    f"{max(r['load'] for r in ok):.1f}" if ok else "",
                    f"{len(ok)}/{len(runs[(library, world)])}",
                ]
            )
    print(
        f"N = {args.n}, B = {args.batch}, MLP 784-256-10, σ = 1, C = 1, about {args.seconds:g} s of timed "
        f"logical steps (at least {args.steps}), 1 thread per process, gloo, median of {args.repeats}\n"
    )
    header = ["library", "processes", "examples/s", "scaling vs 1", "load avg (max)", "runs ok"]
    print(markdown_table(header, rows))
    print()
    if exit_failures:
        print(f"{len(exit_failures)} run(s) failed at shutdown, after the timed part: {exit_failures[0]}\n")
    if args.tiny:
        tiny = {"n": 8, "batch": 2, "steps": 12, "warmup": 1, "seconds": 0.0, "collective_timeout": 20}
        rows = []
        for library in libraries:
            result = run_once(library, 2, tiny, 120.0)
            rows.append([library, "finished" if "error" not in result else "failed: " + result["error"]])
        print("Tiny data: N = 8, q = 0.25, 2 processes, 12 logical steps (collectives time out after 20 s)\n")
        print(markdown_table(["library", "outcome"], rows))
        print()
    print(describe_machine())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
