"""Augmentation multiplicity on the CNN: ``veil train --model cnn --augment K`` at ε = 3.

    python bench/augment.py                                   # digits, K = 1,4,8, seeds 0,1,2
    python bench/augment.py --dataset fashion-mnist --ks 1,4 --seeds 0 --epochs 5 --flip
    python bench/augment.py --step-cost --ks 1,4,8      # clipped step of the 28×28 CNN, K interleaved

Each run is ``veil train`` with its defaults (the CNN's preset, secure randomness, no baseline) and
the stated overrides; only K changes between rows, so the privacy cost is the same in every row
(the sensitivity does not depend on K). Prints a markdown table: DP test accuracy (a non-private
figure, mean ± sd over seeds), ε spent, steps and wall time per run. Run folders go under
``bench/results/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path


def _fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--ks", default="1,4,8", help="comma-separated multiplicities K")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=None, help="override the preset's epochs")
    parser.add_argument("--flip", action="store_true", help="also mirror the copies (--augment-flip)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument(
        "--step-cost",
        action="store_true",
        help="only time one clipped step (forward, backward, per-example clipping) of the Fashion-MNIST "
        "CNN on 256 examples per K, the K values interleaved over --reps rounds (a ratio under load)",
    )
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.step_cost:
        return _step_cost([int(v) for v in args.ks.split(",")], args.reps)

    from veil.training import train

    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        accs, walls, spent = [], [], []
        report = None
        for seed in [int(s) for s in args.seeds.split(",")]:
            out = Path(args.out) / f"augment-{args.dataset}-k{k}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            config = {
                "dataset": args.dataset,
                "model": "cnn",
                "epsilon": args.epsilon,
                "seed": seed,
                "augment": k,
                "augment_flip": args.flip,
                "baseline": False,
                "out": str(out),
                **({"epochs": args.epochs} if args.epochs else {}),
            }
            start = time.monotonic()
            report = train(config, progress=False)
            walls.append(time.monotonic() - start)
            accs.append(report.test_accuracy)
            spent.append(report.epsilon_spent)
            print(
                f"# K={k} seed {seed}: acc {accs[-1]:.4f} in {walls[-1]:.0f} s", file=sys.stderr, flush=True
            )
        assert report is not None
        rows.append(
            [
                str(k),
                f"{max(spent):.3f}",
                _fmt(accs),
                f"{report.epochs} epochs, {report.steps} × q={report.sampling_rate:.3f}, "
                f"σ={report.noise_multiplier:.3f}, C={report.max_grad_norm:g}",
                f"{statistics.mean(walls):.0f}",
            ]
        )
    header = ["K", "ε spent", "DP test acc (non-private figure)", "steps", "wall s per run"]
    machine = f"{platform.machine()} · {os.cpu_count()} CPUs · load {os.getloadavg()[0]:.1f} at the end"
    flip = " + flips" if args.flip else ""
    print(f"\n{args.dataset}, cnn, shifts{flip}, ε = {args.epsilon:g}, seeds {args.seeds} · {machine}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _step_cost(ks: list[int], reps: int, batch: int = 256) -> int:
    import torch

    from veil.augment.multiplicity import expand
    from veil.clipping import PerSampleClipper
    from veil.models import cnn

    torch.manual_seed(0)
    model = cnn((1, 28, 28), 10)
    clipper = PerSampleClipper(model, 0.1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps + 1):  # the first round warms up and is dropped
        for k in ks:
            start = time.perf_counter()
            clipper.group_size = k
            rows, labels = expand(x, y, k, gen, flip=True, pad=2)
            torch.nn.functional.cross_entropy(model(rows), labels).backward()
            clipper.accumulate()
            clipper.reset()
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times[ks[0]][1:])
    print(f"\nclipped step, Fashion-MNIST CNN, {batch} examples · load {os.getloadavg()[0]:.1f}\n")
    print("| K | median s per step | × K = " + str(ks[0]) + " |\n|---|---|---|")
    for k in ks:
        med = statistics.median(times[k][1:])
        print(f"| {k} | {med:.3f} | {med / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
