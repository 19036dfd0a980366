"""Utility benchmark of ``veil train``: DP test accuracy, non-private baseline and wall time.

    python bench/utility.py                          # digits (ε=3), breast-cancer (ε=1), seeds 0-4
    python bench/utility.py --datasets fashion-mnist --seeds 0  # ε=3, ~15-20 minutes on 2 cores
    python bench/utility.py --datasets digits,breast-cancer,fashion-mnist --seeds 0
    python bench/utility.py --datasets digits --seeds 10,11,12 --set lr=0.5 --set epochs=12  # a variant

Prints a markdown table (for docs/benchmarks.md). Each run uses veil's defaults (the tuned presets)
and writes its run folder under ``bench/results/`` (git-ignored). The goals are those of issue 4.
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

GOALS = {
    # dataset: (target ε, accuracy goal, wall-time goal in s or None)
    "digits": (3.0, 0.94, None),
    "breast-cancer": (1.0, 0.93, None),
    "fashion-mnist": (3.0, 0.87, 20 * 60),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--datasets", default="digits,breast-cancer", help="comma-separated: " + ", ".join(GOALS)
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (split, init, noise)")
    parser.add_argument("--out", default="bench/results", help="folder for the run folders")
    parser.add_argument("--no-baseline", action="store_true", help="skip the non-private baselines")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (TOML value: lr=0.5, model='logreg'), repeatable; for tuning the presets",
    )
    args = parser.parse_args(argv)
    overrides = _parse_overrides(parser, args.set)

    from veil.training import train

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = [d for d in datasets if d not in GOALS]
    if unknown:
        parser.error(f"unknown dataset(s) {unknown}; choose from {list(GOALS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for name in datasets:
        epsilon, goal, time_goal = GOALS[name]
        # The goal is stated at its own ε; another ε (--set epsilon=...) is measured without one.
        asked = overrides.get("epsilon", epsilon)
        judged = isinstance(asked, (int, float)) and float(asked) == epsilon
        epsilon = float(asked) if isinstance(asked, (int, float)) else epsilon
        accs, bases, spent, walls = [], [], [], []
        report = None
        for seed in seeds:
            out = Path(args.out) / f"{name}-eps{epsilon:g}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.monotonic()
            report = train(
                {
                    "dataset": name,
                    "epsilon": epsilon,
                    "seed": seed,
                    "out": str(out),
                    "baseline": not args.no_baseline,
                    **overrides,
                },
                progress=False,
            )
            walls.append(time.monotonic() - start)
            accs.append(report.test_accuracy)
            spent.append(report.epsilon_spent)
            if report.baseline_test_accuracy is not None:
                bases.append(report.baseline_test_accuracy)
            print(
                f"# {name} seed {seed}: acc {report.test_accuracy:.4f} in {walls[-1]:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        assert report is not None
        mean_acc = statistics.mean(accs)
        met = mean_acc >= goal and (time_goal is None or max(walls) <= time_goal)
        rows.append(
            [
                name,
                f"{epsilon:g}",
                f"{max(spent):.3f}",
                _fmt(accs),
                _fmt(bases) if bases else "–",
                f"{statistics.mean(bases) - mean_acc:.4f}" if bases else "–",
                (f"≥ {goal}" + (f" in {time_goal // 60} min" if time_goal else "")) if judged else "–",
                ("yes" if met else "NO") if judged else "–",
                report.model,
                f"{report.steps} × q={report.sampling_rate:.3f}, σ={report.noise_multiplier:.3f}",
                f"{statistics.mean(walls):.0f}",
            ]
        )
    header = [
        "dataset",
        "ε",
        "ε spent",
        "DP test acc",
        "baseline acc",
        "drop",
        "goal",
        "met",
        "model",
        "steps",
        "wall s",
    ]
    settings = " · " + ", ".join(args.set) if args.set else ""
    machine = f"{platform.machine()} · {os.cpu_count()} CPUs"
    print(f"\nveil utility benchmark · {machine} · seeds {args.seeds}{settings}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _parse_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs, each value read as TOML (bare words as strings)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the backport veil itself depends on there
        import tomli as tomllib

    overrides: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        overrides[key.strip()] = value
    return overrides


def _fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


if __name__ == "__main__":
    sys.exit(main())
