"""Data-parallel DP-SGD throughput: 1 vs 2 processes (one thread each), veil beside Opacus.

Each configuration (workload × library × world size × repetition) runs in fresh processes started
with ``torch.multiprocessing`` (spawn) that meet through a file rendezvous and talk over gloo on CPU:

* veil, 1 process: ``PrivacyEngine.make_private`` on the plain module (what a one-process user runs);
  "veil" is the default secure engine (noise and sampling from the OS CSPRNG), "veil-seeded" research
  mode (torch's seeded generator, the kind of noise Opacus draws with ``secure_mode=False``, as here);
* veil, 2 processes: ``make_private`` on the ``DistributedDataParallel``-wrapped module (each rank
  samples its shard of every Poisson batch, one all-reduce of the clipped sums per step); "veil" draws
  the next step's noise slice while the all-reduce is in flight (the default), "veil-serial" is the
  same secure engine with that overlap switched off (2 processes only; its ratio is against "veil" in
  1 process, which has no all-reduce to overlap);
* Opacus, 1 process: its ``make_private`` on the plain module; Opacus, 2 processes: on its
  ``DPDDP``-wrapped module (its distributed Poisson sampler), where it runs; "opacus" is its default
  per-sample-gradient hooks, "opacus-ghost" its ghost clipping (``grad_sample_mode="ghost"``).

Workloads (``--workloads N:B,...``): synthetic data (N examples, 784 features, 10 classes), the same MLP
(784 → 256 → tanh → 10), expected logical batch B, σ = 1, C = 1. The first (headline) workload is N =
60,000 (the size of Fashion-MNIST's training set) with B = 2,048 (q ≈ 0.034): DP-SGD is run with large
logical batches (the usual advice is as large as the compute allows, 1,024–4,096), and Opacus runs there
only (its per-sample hooks take seconds a step), to keep the run short. The earlier N = 16,384 with B =
256 follows for veil (add e.g. ``60000:1024`` for more), because the ratio depends on the batch: compute
per step grows with B, the one all-reduce does not. Every rank runs ``--warmup`` logical steps, waits at
a barrier, then times as many logical steps as fill about ``--seconds`` (estimated from the warm-up; at
least ``--steps``; the same count on every rank), and waits at a barrier again; examples/s is the number
of examples in those steps *over all ranks* divided by rank 0's wall time. The scaling ratio is the
2-process examples/s over the 1-process examples/s of the same library. Repetitions are interleaved (rep
1 of every configuration, then rep 2, ...) so drift in the machine's load hits all alike; the table
shows medians and the load average seen during the runs. A second table runs each library once on tiny
data (8 examples, q = 0.25, 2 processes, where local batches are often empty) and says whether it
finished. ``--profile`` prints where one veil step's time goes instead (per rank, 1 and 2 processes, ms
per logical step).

Usage::

    python bench/distributed.py              # everything: about 4 minutes on 2 idle cores
    python bench/distributed.py --no-tiny --libraries veil,veil-serial,veil-seeded,opacus-ghost  # ~3 min
    python bench/distributed.py --quick      # smoke run: few steps, one repetition
    python bench/distributed.py --profile    # per-phase time of a veil step, 1 and 2 processes
    python bench/distributed.py --allreduce  # the all-reduce alone: whole vs 4 pieces, gloo options
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

LIBRARIES = ("veil", "veil-serial", "veil-seeded", "opacus", "opacus-ghost")
ONE_PROCESS_AS = {"veil-serial": "veil"}  # variants that differ only across processes


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
        if library == "veil-serial" and world > 1:
            private[1].overlap_noise = False  # draw each step's noise slice before its all-reduce
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
                exit_failures.append(f"{library}, {world} processes: {error}")
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


class _Phases:
    """Milliseconds per phase of a veil step on one rank, by wrapping the calls each phase makes."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + 1000 * seconds

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)

        return timed


def _profile_rank(
    rank: int, world: int, library: str, settings: dict[str, Any], rendezvous: str, out: str
) -> None:
    """One rank of ``--profile``: veil's step split into phases, ms per logical step (rank 0's file)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model, optimizer, loader, crit = _make_private(library, world, settings)
        phases = _Phases()
        optimizer.clipper.accumulate = phases.wrap(
            "per-example norms + clipped sum", optimizer.clipper.accumulate
        )
        optimizer._on_release = phases.wrap("accounting", optimizer._on_release)
        optimizer.original_optimizer.step = phases.wrap("SGD update", optimizer.original_optimizer.step)
        write = optimizer._write_private_grads
        noise = optimizer._noise.normal
        optimizer._noise.normal = phases.wrap("noise draw (in flight when overlapped)", noise)
        reduce = dist.all_reduce

        class _Handle:  # times the wait for an asynchronous all-reduce
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self) -> Any:
                start = time.perf_counter()
                try:
                    return self.work.wait()
                finally:
                    phases.add("all-reduce: launch + wait", time.perf_counter() - start)

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            work = reduce(*args, **kwargs)
            phases.add("all-reduce: launch + wait", time.perf_counter() - start)
            return _Handle(work) if work is not None else None

        def write_private_grads() -> None:
            dist.all_reduce = all_reduce
            try:
                phases.wrap("noise + all-reduce + release (total)", write)()
            finally:
                dist.all_reduce = reduce

        optimizer._write_private_grads = write_private_grads
        batches = iter(loader)

        def step() -> None:
            nonlocal batches
            start = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            phases.add("sampling + loading the batch", time.perf_counter() - start)
            start = time.perf_counter()
            optimizer.zero_grad()
            output = model(x)
            phases.add("forward", time.perf_counter() - start)
            start = time.perf_counter()
            crit(output, y).backward()
            phases.add("backward", time.perf_counter() - start)
            optimizer.step()

        for _ in range(settings["warmup"]):
            step()
        phases.ms.clear()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(settings["steps"]):
            step()
        dist.barrier()
        phases.add("whole step (wall)", time.perf_counter() - start)
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        for _ in range(3):
            dist.all_reduce(flat)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(flat)
        alone = (time.perf_counter() - start) / 20 * settings["steps"]
        phases.add(f"(the all-reduce alone, {flat.numel():,} floats, ranks in step)", alone)
        per_step = {name: ms / settings["steps"] for name, ms in phases.ms.items()}
        Path(f"{out}.{rank}").write_text(json.dumps(per_step))
    finally:
        dist.destroy_process_group()


def profile(workloads: list[tuple[int, int]], libraries: list[str], steps: int) -> None:
    """Print the per-phase table of ``--profile`` for each workload and veil library."""
    for n, batch in workloads:
        for library in [name for name in libraries if name.startswith("veil")]:
            columns: dict[str, dict[str, float]] = {}
            for world in (1, 2):
                if world == 1 and library in ONE_PROCESS_AS:
                    continue
                settings = {"n": n, "batch": batch, "steps": steps, "warmup": 3}
                with tempfile.TemporaryDirectory() as tmp:
                    mp.start_processes(
                        _profile_rank,
                        args=(world, library, settings, f"{tmp}/rendezvous", f"{tmp}/phases"),
                        nprocs=world,
                        start_method="spawn",
                    )
                    for rank in range(world):
                        columns[f"{world} proc, rank {rank}"] = json.loads(
                            Path(f"{tmp}/phases.{rank}").read_text()
                        )
            names = list(dict.fromkeys(name for column in columns.values() for name in column))
            rows = [[name, *(f"{c.get(name, 0.0):.2f}" for c in columns.values())] for name in names]
            print(
                f"{library}, N = {n}, B = {batch}: ms per logical step, mean of {steps} steps, "
                f"load average {os.getloadavg()[0]:.1f}\n"
            )
            print(markdown_table(["phase", *columns], rows))
            print()


def _allreduce_rank(rank: int, world: int, variant: str, numel: int, rendezvous: str, out: str) -> None:
    """One rank of ``--allreduce``: ms and process-CPU ms per all-reduce of ``numel`` float32."""
    torch.set_num_threads(1)
    options = {}
    if variant.startswith("lo-devices"):
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")] * int(variant[-1])
        options["pg_options"] = opts
    elif variant == "GLOO_SOCKET_IFNAME=lo":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, **options
    )
    try:
        buffer = torch.ones(numel)
        pieces = list(buffer.split(math.ceil(numel / 4)))
        result = {}
        for name, call in (
            ("one all-reduce of the whole buffer", lambda: dist.all_reduce(buffer)),
            (
                "4 async all-reduces of quarter pieces",
                lambda: [w.wait() for w in [dist.all_reduce(p, async_op=True) for p in pieces]],
            ),
        ):
            for _ in range(5):
                call()
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(100):
                call()
            result[name] = (10 * (time.perf_counter() - start), 10 * (time.process_time() - cpu))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def allreduce(repeats: int) -> None:
    """Print ``--allreduce``: the bench model's all-reduce, whole vs in pieces, under gloo variants."""
    numel = sum(p.numel() for p in _model().parameters())
    variants = ["gloo defaults", "GLOO_SOCKET_IFNAME=lo", "lo-devices 1", "lo-devices 2"]
    seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(repeats):  # interleaved
        for variant in variants:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(
                    _allreduce_rank,
                    args=(2, variant, numel, f"{tmp}/rendezvous", f"{tmp}/out"),
                    nprocs=2,
                    start_method="spawn",
                )
                for name, figures in json.loads(Path(f"{tmp}/out").read_text()).items():
                    seen.setdefault((variant, name), []).append(tuple(figures))
    rows = [
        [
            variant,
            name,
            ", ".join(f"{wall:.2f}" for wall, _ in runs),
            ", ".join(f"{cpu:.2f}" for _, cpu in runs),
        ]
        for (variant, name), runs in seen.items()
    ]
    print(
        f"{numel:,} float32 over gloo, 2 processes, mean of 100 calls per run, {repeats} interleaved runs, "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print(markdown_table(["gloo", "how", "wall ms per call (runs)", "rank 0 process CPU ms"], rows))
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default="60000:2048,16384:256",
        help="N:B pairs (dataset size : expected batch); Opacus runs on the first one only",
    )
    parser.add_argument("--steps", type=int, default=3, help="at least this many timed logical steps")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed steps fill about this long")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 repetition")
    parser.add_argument("--profile", action="store_true", help="per-phase time of a veil step instead")
    parser.add_argument(
        "--allreduce", action="store_true", help="the all-reduce alone: whole vs pieces, gloo options"
    )
    parser.add_argument(
        "--no-tiny", dest="tiny", action="store_false", help="skip the tiny-data run (8 examples, 2 ranks)"
    )
    args = parser.parse_args(argv)
    workloads = [(int(n), int(b)) for n, b in (pair.split(":") for pair in args.workloads.split(",") if pair)]
    if args.quick:
        args.steps, args.seconds, args.warmup, args.repeats = 2, 0.0, 1, 1
        workloads = [(512, 32)]
    libraries = [name for name in args.libraries.split(",") if name]
    if args.allreduce:
        allreduce(args.repeats)
        print(describe_machine())
        return 0
    if args.profile:
        profile(workloads, libraries, max(args.steps, 20))
        print(describe_machine())
        return 0
    configs = [
        (n, batch, library, world)
        for n, batch in workloads
        for library in libraries
        for world in (1, 2)
        if not (world == 1 and library in ONE_PROCESS_AS)
        and not (library.startswith("opacus") and (n, batch) != workloads[0])
    ]
    runs: dict[tuple[int, int, str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    began = time.strftime("%H:%M", time.gmtime())
    for rep in range(args.repeats):
        for i in range(len(configs)):
            n, batch, library, world = configs[(i + rep) % len(configs)]
            settings = {
                "n": n,
                "batch": batch,
                "steps": args.steps,
                "warmup": args.warmup,
                "seconds": args.seconds,
            }
            runs[(n, batch, library, world)].append(run_once(library, world, settings, args.timeout))
    ended = time.strftime("%H:%M", time.gmtime())

    def rate(config: tuple[int, int, str, int]) -> float | None:
        ok = [r for r in runs.get(config, []) if "error" not in r]
        return statistics.median(r["examples_per_s"] for r in ok) if ok else None

    rows = []
    for n, batch, library, world in configs:
        results = runs[(n, batch, library, world)]
        ok = [r for r in results if "error" not in r]
        errors = [r["error"] for r in results if "error" in r]
        mine = rate((n, batch, library, world))
        one = rate((n, batch, ONE_PROCESS_AS.get(library, library), 1))
        ratio = mine / one if world == 2 and mine and one else None
        rows.append(
            [
                f"{n:,} / {batch:,}",
                library,
                world,
                f"{mine:,.0f}" if mine is not None else "failed: " + (errors[0] if errors else "?"),
                f"{ratio:.2f}×" if ratio is not None else "",
                f"{max(r['load'] for r in ok):.1f}" if ok else "",
                f"{len(ok)}/{len(results)}",
            ]
        )
    print(
        f"MLP 784-256-10, σ = 1, C = 1, about {args.seconds:g} s of timed logical steps (at least "
        f"{args.steps}), 1 thread per process, gloo, median of {args.repeats}, {began}–{ended} UTC\n"
    )
    header = ["N / B", "library", "processes", "examples/s", "scaling vs 1", "load avg (max)", "runs ok"]
    print(markdown_table(header, rows))
    print()
    if exit_failures:
        print(f"{len(exit_failures)} run(s) failed at shutdown, after the timed part (results kept):")
        for failure in exit_failures:
            print(f"- {failure}")
        print()
    if args.tiny:
        tiny = {"n": 8, "batch": 2, "steps": 12, "warmup": 1, "seconds": 0.0, "collective_timeout": 20}
        rows = []
        for library in [name for name in libraries if name not in ONE_PROCESS_AS]:
            result = run_once(library, 2, tiny, 120.0)
            rows.append([library, "finished" if "error" not in result else "failed: " + result["error"]])
        print("Tiny data: N = 8, q = 0.25, 2 processes, 12 logical steps (collectives time out after 20 s)\n")
        print(markdown_table(["library", "outcome"], rows))
        print()
    print(describe_machine())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
