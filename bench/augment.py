"""Augmentation multiplicity on the CNN: ``veil train --model cnn --augment K`` at ε = 3.

    python bench/augment.py                                   # digits, K = 1,4,8, seeds 0,1,2
    python bench/augment.py --dataset fashion-mnist --ks 1,4 --seeds 0 --epochs 5 --flip

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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
