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
* peak MiB — CPU: the process's resident-set high-water mark during training minus its size right
  before training (``/proc/self/status`` VmHWM after a reset; model, data and libraries excluded);
  CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before training.

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
    markdown_table,
    peak_rss_since_reset_bytes,
    reset_peak_rss,
)

MODES = ("plain", "veil", "opacus-hooks", "opacus-ghost")
CONFIGS = ("cnn", "mlp", "transformer")
DESCRIPTIONS = {
    "cnn": "SimpleCNN (conv 1→32 3×3, ReLU, max-pool 2, linear 5408→10), batch 256, 28×28",
    "mlp": "MLP 100 → 256 → 256 → 2 (ReLU), tabular, batch 256",
    "transformer": "2-layer transformer encoder (d_model 64, 4 heads, FF 256), seq 128, batch 32",
}
BATCH = {"cnn": 256, "mlp": 256, "transformer": 32}


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
    if mode == "veil":
        import veil

        engine = veil.PrivacyEngine(seed=0)
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
    """One configuration in this (fresh) process; returns its measurements."""
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

    def step(xb: Any, yb: Any) -> None:
        optimizer.zero_grad()
        loss(model(xb), yb).backward()
        optimizer.step()

    if cuda:
        torch.cuda.synchronize()
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base_mem = current_rss_bytes()
        resettable = reset_peak_rss()
    base_total = peak_rss_since_reset_bytes() if not cuda else base_mem
    for _ in range(args.warmup):
        step(x, y)
    with Stopwatch(cuda) as timer:
        for _ in range(args.steps):
            step(x, y)
    step_rate = batch * args.steps / timer.seconds

    seen = 0
    with Stopwatch(cuda) as epoch_timer:
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            step(xb, yb)
            seen += len(xb)
    epoch_rate = seen / epoch_timer.seconds if epoch_timer.seconds > 0 else float("nan")

    if cuda:
        peak = torch.cuda.max_memory_allocated()
        extra = peak - base_mem
    else:
        peak = peak_rss_since_reset_bytes()
        extra = peak - base_mem if resettable else peak - base_total
    return {
        "step_rate": step_rate,
        "epoch_rate": epoch_rate,
        "peak_bytes": peak,
        "extra_bytes": max(extra, 0),
        "epoch_examples": seen,
    }


# ---------------------------------------------------------------------------------------------
# driver


def run_one(config: str, mode: str, args: argparse.Namespace) -> dict[str, Any] | None:
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
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        print(f"  {config}/{mode} failed: {tail[0]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
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

    rows = []
    for config in configs:
        plain = results.get((config, "plain"))
        base = (
            {k: statistics.median(r[k] for r in plain) for k in ("step_rate", "epoch_rate", "extra_bytes")}
            if plain
            else None
        )
        for mode in modes:
            runs = results.get((config, mode))
            if not runs:
                rows.append([config, mode, "failed", "", "", "", "", "", ""])
                continue
            med = {
                k: statistics.median(r[k] for r in runs)
                for k in ("step_rate", "epoch_rate", "extra_bytes", "peak_bytes")
            }
            rows.append(
                [
                    config,
                    mode,
                    med["step_rate"],
                    _ratio(med, base, "step_rate"),
                    med["epoch_rate"],
                    _ratio(med, base, "epoch_rate"),
                    med["extra_bytes"] / 2**20,
                    _ratio(med, base, "extra_bytes"),
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
        "training peak MiB",
        "vs plain",
        "process peak MiB",
    ]
    print(f"# veil engine benchmark ({args.device}{', quick' if args.quick else ''})\n")
    for c in configs:
        print(f"- {c}: {DESCRIPTIONS[c]}")
    print(
        f"\nMedians over {args.reps} interleaved repetition(s); {args.steps} timed steps after {args.warmup} "
        f"warm-up; epoch = {args.epoch_steps} expected steps incl. Poisson loading; σ = 1, C = 1, SGD.\n"
    )
    print(markdown_table(header, rows))
    print("\nMachine:\n")
    print(describe_machine(args.device))


if __name__ == "__main__":
    main()
