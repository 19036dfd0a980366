"""Opacus on its own ``examples/mnist.py`` settings, run on Fashion-MNIST for a list of target ε.

Why: issue 29 asks for veil's accuracy-by-ε curve beside what Opacus gives a user who follows its own
MNIST example. MNIST is not available on this machine, so the example's settings are applied to
Fashion-MNIST (same 1×28×28 images, 10 classes, 60,000/10,000 split).

The settings of Opacus's ``examples/mnist.py`` (read from the pytorch/opacus repository), reproduced
here with Opacus's own public API:

* model: its ``SampleConvNet`` (conv 16@8×8 stride 2 pad 3, max-pool 2/1, conv 32@4×4 stride 2,
  max-pool 2/1, linear 512→32, linear 32→10, ReLU);
* optimizer: SGD, lr 0.1, no momentum; batch size 64 given to ``make_private``, which replaces the loader
  by Poisson sampling at rate 64/60,000 (the example's default ``poisson_sampling=True``);
* 10 epochs, max per-sample gradient norm C = 1.0, δ = 1e-5, ``PrivacyEngine()`` with its default
  accountant (PRV in Opacus 1.6) and ``secure_mode=False`` (the example's default);
* pixels scaled to [0, 1] then normalised with the dataset's published mean and standard deviation (the
  example uses MNIST's; here Fashion-MNIST's published 0.2860/0.3530: public constants, not a statistic of
  the private rows);
* test accuracy of the final model only (no model selection), test batch 1024.

One change: the example fixes σ (``--sigma 1.0``); here ``make_private_with_epsilon`` calibrates σ for
each target ε over the same 10 epochs, as the issue asks for a curve by ε. Data loading is in-process
(no worker) and on the CPU, with ``--threads`` torch threads (1 by default on the shared machine).

Reported per ε: the calibrated σ, the ε Opacus's accountant reports after training, test accuracy,
training wall time and the process's CPU time over it (evaluation and data loading excluded; CPU time
is the figure to compare on a shared machine), torch threads and the load average before and after.
``--out`` appends each row as one JSON line, so that runs of one ε at a time can be collected.

Data: read with veil's IDX reader (``veil.data.idx.load_idx_dataset``) from
/usr/share/datasets/fashion-mnist (Debian package ``dataset-fashion-mnist``).

Usage::

    python bench/opacus_mnist_settings.py --epsilons 3            # one ε, the example's settings
    python bench/opacus_mnist_settings.py --epsilons 3,1,8,0.5,2 --out runs/opacus_curve.jsonl
    python bench/opacus_mnist_settings.py --epochs 2 ...          # a reduced run: labelled so in the table
    python bench/opacus_mnist_settings.py --non-private           # the example's --disable-dp reference
    python bench/opacus_mnist_settings.py --table runs/opacus_curve.jsonl   # the table of collected runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table
from veil.data.idx import load_idx_dataset

DATA_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # published Fashion-MNIST pixel statistics
EXAMPLE = {"epochs": 10, "batch_size": 64, "lr": 0.1, "clip": 1.0, "delta": 1e-5}
"""The defaults of Opacus's examples/mnist.py (σ aside: calibrated per target ε here)."""
HEADER = [
    "target ε",
    "epochs",
    "σ (calibrated)",
    "ε spent (Opacus PRV)",
    "test accuracy",
    "train time (s)",
    "train CPU (s)",
    "threads",
    "load avg before → after",
    "settings",
]


class ExampleConvNet(nn.Module):
    """The architecture of the example's ``SampleConvNet`` (written here, same layer shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=3)  # 28 → 14
        self.conv2 = nn.Conv2d(16, 32, kernel_size=4, stride=2)  # 13 → 5
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), kernel_size=2, stride=1)  # 14 → 13
        x = F.max_pool2d(F.relu(self.conv2(x)), kernel_size=2, stride=1)  # 5 → 4
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_split(
    data_dir: str, train_limit: int | None, test_limit: int | None
) -> tuple[TensorDataset, TensorDataset]:
    """Fashion-MNIST through veil's reader, scaled to [0, 1] and normalised by the published constants."""
    data = load_idx_dataset("fashion-mnist", data_dir)

    def tensors(x: np.ndarray, y: np.ndarray, limit: int | None) -> TensorDataset:
        x, y = x[:limit], y[:limit]
        pixels = (torch.from_numpy(x) / 255.0 - FASHION_MEAN) / FASHION_STD
        return TensorDataset(pixels, torch.from_numpy(y))

    return tensors(data.x_train, data.y_train, train_limit), tensors(data.x_test, data.y_test, test_limit)


def test_accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=1024):
            correct += int((model(x).argmax(dim=1) == y).sum())
    return correct / len(data)


def run_one(
    target_epsilon: float | None, train: TensorDataset, test: TensorDataset, args: argparse.Namespace
) -> dict[str, Any]:
    """Train once at ``target_epsilon`` with the example's settings; the row for the table.

    ``target_epsilon=None``: the example's ``--disable-dp`` path (plain SGD over its unshuffled loader of
    64-image batches), a non-private reference for the same model and schedule.
    """
    torch.manual_seed(args.seed)
    model: nn.Module = ExampleConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0)
    loader = DataLoader(train, batch_size=args.batch_size)  # DP: replaced by Poisson sampling below
    engine = None
    if target_epsilon is not None:
        from opacus import PrivacyEngine

        engine = PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns about secure_mode=False, the example's default
            model, optimizer, loader = engine.make_private_with_epsilon(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                target_epsilon=target_epsilon,
                target_delta=args.delta,
                epochs=args.epochs,
                max_grad_norm=args.clip,
            )
    criterion = nn.CrossEntropyLoss()
    load_before = os.getloadavg()
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
        print(f"ε {target_epsilon}: epoch {epoch}/{args.epochs} at {elapsed:.0f} s", file=sys.stderr)
    train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    load_after = os.getloadavg()
    reduced = args.epochs != EXAMPLE["epochs"] or args.batch_size != EXAMPLE["batch_size"]
    reduced = (
        reduced or args.lr != EXAMPLE["lr"] or args.clip != EXAMPLE["clip"] or args.delta != EXAMPLE["delta"]
    )
    reduced = reduced or args.train_limit is not None or args.test_limit is not None
    return {
        "target_epsilon": target_epsilon,
        "epochs": args.epochs,
        "sigma": None if engine is None else float(optimizer.noise_multiplier),
        "epsilon_spent": None if engine is None else float(engine.get_epsilon(args.delta)),
        "test_accuracy": test_accuracy(model, test),
        "train_seconds": train_seconds,
        "train_cpu_seconds": cpu_seconds,
        "threads": torch.get_num_threads(),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in load_after],
        "settings": ("REDUCED (not the example's)" if reduced else "examples/mnist.py")
        + (" --disable-dp (NOT PRIVATE)" if engine is None else ""),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "train_size": len(train),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "opacus": __import__("opacus").__version__,
        "torch": torch.__version__,
    }


def table_row(r: dict[str, Any]) -> list[Any]:
    before, after = r["load_before"], r["load_after"]
    return [
        "non-private" if r["target_epsilon"] is None else r["target_epsilon"],
        r["epochs"],
        "–" if r["sigma"] is None else f"{r['sigma']:.3f}",
        "∞ (not private)" if r["epsilon_spent"] is None else f"{r['epsilon_spent']:.3f}",
        f"{r['test_accuracy']:.4f}",
        f"{r['train_seconds']:.0f}",
        f"{r['train_cpu_seconds']:.0f}" if "train_cpu_seconds" in r else "–",
        r["threads"],
        f"{before[0]:.1f} → {after[0]:.1f}",
        r["settings"],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epsilons", default="3,1,8,0.5,2", help="target ε, comma-separated, run in order")
    parser.add_argument("--epochs", type=int, default=EXAMPLE["epochs"])
    parser.add_argument(
        "--batch-size", type=int, default=EXAMPLE["batch_size"], help="expected Poisson batch"
    )
    parser.add_argument("--lr", type=float, default=EXAMPLE["lr"])
    parser.add_argument("--clip", type=float, default=EXAMPLE["clip"], help="max per-sample gradient norm")
    parser.add_argument("--delta", type=float, default=EXAMPLE["delta"])
    parser.add_argument("--non-private", action="store_true", help="the example's --disable-dp run instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--train-limit", type=int, default=None, help="first N training images (smoke runs)")
    parser.add_argument("--test-limit", type=int, default=None, help="first N test images (smoke runs)")
    parser.add_argument("--out", type=Path, default=None, help="append each result as a JSON line here")
    parser.add_argument("--table", type=Path, default=None, help="print a --out file as a table; no training")
    args = parser.parse_args(argv)
    if args.table is not None:
        results = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        print(markdown_table(HEADER, [table_row(r) for r in results]))
        return 0

    torch.set_num_threads(args.threads)
    epsilons: list[float | None] = (
        [None] if args.non_private else [float(e) for e in args.epsilons.split(",")]
    )
    train, test = load_split(args.data_dir, args.train_limit, args.test_limit)
    rows = []
    for eps in epsilons:
        result = run_one(eps, train, test, args)
        rows.append(table_row(result))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
    print(markdown_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
