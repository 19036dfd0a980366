"""Training-step throughput and peak memory: plain PyTorch vs veil DP-SGD vs Opacus (hooks, ghost).

One run prints one markdown table and the machine description. Every (model, mode, repetition) runs
in its own subprocess, so each peak-memory reading is that configuration's alone; repetitions are
interleaved (rep 1 of every mode, then rep 2, ... with the mode order rotated) so slow drift of the
machine's load hits every mode alike. Reported: medians over repetitions.

Metrics per configuration:

* step ex/s — examples per second of ``zero_grad → forward → loss → backward → step`` on a fixed
  batch (after warm-up);
* epoch ex/s — examples per second over a whole (short) epoch *including data loading*, with each
  library's Poisson loader for the private modes and a shuffled loader for plain PyTorch;
* step peak MiB — peak memory over the fixed-batch steps; epoch peak MiB — over the epoch, whose
  Poisson batches vary in size (the largest is shown: activations grow with it, so a DP mode's
  epoch peak reflects the sampling as well as the library). Both come from a separate, shorter
  run of the same configuration (warm-up, two steps, the epoch), so the throughput run is not
  instrumented. CPU: the process's resident-set high-water mark (``/proc/self/status`` VmHWM,
  reset before each phase) minus its size right before training (model, data and libraries
  excluded), with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``) so that a
  freed tensor's pages go back to the system at once. With glibc's default *dynamic* threshold,
  freed multi-MiB blocks stay in the heap and whether a later allocation reuses them depends on
  the order of frees: the same configuration then reads anywhere within about ±20 MiB from run
  to run (the CNN's activations are 21 MiB blocks), which measures the allocator's caching rather
  than what training needs. CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before
  training (live tensors: the same notion).

Usage::

    python bench/engine.py                 # full run (minutes; run it on a quiet machine)
    python bench/engine.py --quick         # smoke run: tiny step counts, one repetition
    python bench/engine.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Stopwatch,
    current_rss_bytes,
    describe_machine,
    fixed_batch_drawn,
    markdown_table,
    peak_rss_since_reset_bytes,
    reset_peak_rss,
)

MODES = ("plain", "veil", "veil-seeded", "opacus-hooks", "opacus-ghost")
CONFIGS = ("cnn", "mlp", "transformer")
DESCRIPTIONS = {
    "cnn": "SimpleCNN (conv 1→32 3×3, ReLU, max-pool 2, linear 5408→10), batch 256, 28×28",
    "mlp": "MLP 100 → 256 → 256 → 2 (ReLU), tabular, batch 256",
    "transformer": "2-layer transformer encoder (d_model 64, 4 heads, FF 256), seq 128, batch 32",
}
BATCH = {"cnn": 256, "mlp": 256, "transformer": 32}
MMAP_THRESHOLD = 128 * 1024  # bytes; fixed, so glibc returns freed tensors to the system at once


# ---------------------------------------------------------------------------------------------
# models and data


class SimpleCNN(nn.Module):
    """The SimpleCNN of the issue: conv 1→32 (3×3), ReLU, max-pool 2, linear 5408→10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.relu1 = nn.ReLU()
        self.maxpool1 = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 13 * 13, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(torch.flatten(self.maxpool1(self.relu1(self.conv1(x))), 1))


class Encoder(nn.Module):
    """Token + learned position embeddings, 2 × nn.TransformerEncoderLayer, mean-pool, linear head."""

    def __init__(self, vocab: int = 1000, length: int = 128, d: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(length, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1).contiguous()
        return self.head(self.encoder(self.tok(x) + self.pos(positions)).mean(1))


def build(config: str) -> tuple[nn.Module, Callable[[int], TensorDataset], nn.Module]:
    """(model, dataset factory(n), loss) for a configuration."""
    if config == "cnn":
        return (
            SimpleCNN(),
            lambda n: TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))),
            nn.CrossEntropyLoss(),
        )
    if config == "mlp":
        model = nn.Sequential(
            nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
        )
        return (
            model,
            lambda n: TensorDataset(torch.randn(n, 100), torch.randint(0, 2, (n,))),
            nn.CrossEntropyLoss(),
        )
    if config == "transformer":
        return (
            Encoder(),
            lambda n: TensorDataset(torch.randint(0, 1000, (n, 128)), torch.randint(0, 2, (n,))),
            nn.CrossEntropyLoss(),
        )
    raise SystemExit(f"unknown config {config!r}; choose from {CONFIGS}")


def make_mode(mode: str, model: Any, dataset: Any, loss: Any, batch: int) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, loader, loss) for one mode; DP modes use σ = 1, C = 1, Poisson sampling."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True)
    if mode == "plain":
        return model, optimizer, loader, loss
    if mode in ("veil", "veil-seeded", "veil-urandom"):
        import veil

        # "veil" is the default (noise and sampling from the secure ChaCha20 stream keyed by the OS);
        # "veil-seeded" is research mode, so the two rows together give the time cost of secure noise.
        # "veil-urandom" (not in the default modes) is the default engine with the secure sampler veil
        # used before the keystream (bench/legacy_noise.py): old and new timed in one run.
        engine = (
            veil.PrivacyEngine(seed=0, reproducible=True) if mode == "veil-seeded" else veil.PrivacyEngine()
        )
        if mode == "veil-urandom":
            from legacy_noise import UrandomSource

            engine.noise_source, engine.sampler_source = UrandomSource(), UrandomSource()
        m, opt, dl = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            criterion=loss,
        )
        return m, opt, dl, loss
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    fixed = ModuleValidator.fix(model)  # MultiheadAttention → DPMultiheadAttention (transformer only)
    if fixed is not model:
        model = fixed
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = PrivacyEngine()
    kind = mode.split("-", 1)[1]
    out = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode=kind,
        criterion=loss,
        poisson_sampling=True,
    )
    if kind == "ghost":
        m, opt, crit, dl = out
        return m, opt, dl, crit
    m, opt, dl = out
    return m, opt, dl, loss


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this (fresh) process; returns its measurements.

    ``args.memory``: the memory run (warm-up, two steps, the epoch; peak memory only);
    otherwise the throughput run (no memory readings).
    """
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch = BATCH[args.config]
    model, data, loss = build(args.config)
    model = model.to(device)
    dataset = data(batch * args.epoch_steps)
    model, optimizer, loader, loss = make_mode(args.mode, model, dataset, loss, batch)
    x, y = data(batch).tensors
    x, y = x.to(device), y.to(device)

    def step(xb: Any, yb: Any, fixed: bool = True) -> None:
        if fixed:
            fixed_batch_drawn(loader)
        optimizer.zero_grad()
        loss(model(xb), yb).backward()
        optimizer.step()

    largest = 0

    def epoch() -> tuple[int, float]:
        nonlocal largest
        seen = 0
        with Stopwatch(cuda) as timer:
            for xb, yb in loader:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                step(xb, yb, fixed=False)
                seen += len(xb)
                largest = max(largest, len(xb))
        return seen, timer.seconds

    if args.memory:
        base = torch.cuda.memory_allocated() if cuda else current_rss_bytes()

        def reset() -> bool:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                return True
            return reset_peak_rss()

        def peak() -> int:
            if cuda:
                torch.cuda.synchronize()
                return torch.cuda.max_memory_allocated()
            return peak_rss_since_reset_bytes()

        resettable = reset()
        for _ in range(args.warmup + 2):
            step(x, y)
        step_peak = peak()
        if resettable:
            reset()
        seen, _ = epoch()
        epoch_peak = peak()
        return {
            "step_extra_bytes": max(step_peak - base, 0),
            "epoch_extra_bytes": max(epoch_peak - base, 0),
            "peak_bytes": max(step_peak, epoch_peak),
            "epoch_examples": seen,
            "max_batch": largest,
        }

    for _ in range(args.warmup):
        step(x, y)
    with Stopwatch(cuda) as timer:
        for _ in range(args.steps):
            step(x, y)
    seen, seconds = epoch()
    return {
        "step_rate": batch * args.steps / timer.seconds,
        "epoch_rate": seen / seconds if seconds > 0 else float("nan"),
        "epoch_examples": seen,
    }


# ---------------------------------------------------------------------------------------------
# driver


def run_one(config: str, mode: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The throughput run and then the memory run of one configuration, each in a fresh process."""
    result: dict[str, Any] = {}
    for memory in (False, True):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--config",
            config,
            "--mode",
            mode,
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--epoch-steps",
            str(args.epoch_steps),
            *(["--memory"] if memory else []),
        ]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if memory:
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            print(f"  {config}/{mode} failed: {tail[0]}", file=sys.stderr)
            return None
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return result


def _ratio(med: dict[str, float], base: dict[str, float] | None, key: str) -> str:
    return f"{med[key] / base[key]:.2f}×" if base and base[key] else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, one repetition")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per configuration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--epoch-steps", type=int, default=None, help="expected steps in the measured epoch")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.quick:
        args.reps, args.warmup = 1, 1
        args.steps = args.steps or 2
        args.epoch_steps = args.epoch_steps or 2
    args.steps = args.steps or 20
    args.epoch_steps = args.epoch_steps or 10
    configs = [c for c in args.configs.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]

    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for config in configs:
            for mode in order:
                print(f"rep {rep + 1}/{args.reps}: {config} / {mode}", file=sys.stderr, flush=True)
                r = run_one(config, mode, args)
                if r is not None:
                    results.setdefault((config, mode), []).append(r)

    keys = ("step_rate", "epoch_rate", "step_extra_bytes", "epoch_extra_bytes", "peak_bytes", "max_batch")
    rows = []
    for config in configs:
        plain = results.get((config, "plain"))
        base = {k: statistics.median(r[k] for r in plain) for k in keys} if plain else None
        for mode in modes:
            runs = results.get((config, mode))
            if not runs:
                rows.append([config, mode, "failed", *[""] * 10])
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in keys}
            rows.append(
                [
                    config,
                    mode,
                    med["step_rate"],
                    _ratio(med, base, "step_rate"),
                    med["epoch_rate"],
                    _ratio(med, base, "epoch_rate"),
                    med["step_extra_bytes"] / 2**20,
                    _ratio(med, base, "step_extra_bytes"),
                    med["epoch_extra_bytes"] / 2**20,
                    _ratio(med, base, "epoch_extra_bytes"),
                    int(med["max_batch"]),
                    med["peak_bytes"] / 2**20,
                ]
            )
    header = [
        "model",
        "mode",
        "step ex/s",
        "vs plain",
        "epoch ex/s",
        "vs plain",
        "step peak MiB",
        "vs plain",
        "epoch peak MiB",
        "vs plain",
        "largest epoch batch",
        "process peak MiB",
    ]
    print(f"# veil engine benchmark ({args.device}{', quick' if args.quick else ''})\n")
    for c in configs:
        print(f"- {c}: {DESCRIPTIONS[c]}")
    print(
        f"\nMedians over {args.reps} interleaved repetition(s); {args.steps} timed steps after {args.warmup} "
        f"warm-up; epoch = {args.epoch_steps} expected steps incl. Poisson loading; σ = 1, C = 1, SGD. "
        f"Peak memory from a separate run ({args.warmup + 2} steps + the epoch)"
        + (f", glibc mmap threshold fixed at {MMAP_THRESHOLD // 1024} KiB" if args.device == "cpu" else "")
        + ".\n"
    )
    print(markdown_table(header, rows))
    print("\nMachine:\n")
    print(describe_machine(args.device))


if __name__ == "__main__":
    main()
