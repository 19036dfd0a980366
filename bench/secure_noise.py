"""The cost of secure noise, measured so that a loaded machine still gives usable ratios.

1. One Gaussian noise draw: each source draws ``N(0, 1)`` float32 noise of the sizes below (the CNN
   and MLP of ``bench/engine.py`` need 54,314 and 92,162 coordinates a step): secure (ChaCha20
   keystream, the default), the previous secure sampler (``os.urandom``, two draws; see
   ``legacy_noise.py``) and seeded (``torch.Generator``).
2. One DP-SGD step of ``bench/engine.py``'s MLP and CNN (batch 256, σ = 1, C = 1, fixed batch) in
   the modes plain, veil (secure), veil-urandom (the previous secure sampler) and veil-seeded.

Everything runs in one process with rounds interleaved (one draw, or one step, of every source or
mode per round), so load drift hits every source alike. Reported: the median and the best of the
rounds, and each against the seeded draw / the plain step. ``bench/engine.py`` (one process per
configuration, whole epochs, peak memory) is the reference on an idle machine; this script is the
one to trust when the machine is shared.

Usage::

    python bench/secure_noise.py                # sizes 54314,92162,1000000; 30 draw rounds, 100 steps
    python bench/secure_noise.py --rounds 100 --sizes 92162 --steps 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table
from legacy_noise import UrandomSource
from veil.mechanisms import SecureSource, SeededSource

MODES = ("plain", "veil", "veil-urandom", "veil-seeded")


def _steps(config: str, rounds: int) -> list[list[object]]:
    """Rows of the step table for one model: each mode's step timed once per round, rounds interleaved."""
    import torch

    from engine import BATCH, build, make_mode

    torch.manual_seed(0)
    steps = {}
    for mode in MODES:
        model, data, loss = build(config)
        model, optimizer, _, loss = make_mode(mode, model, data(BATCH[config]), loss, BATCH[config])
        x, y = data(BATCH[config]).tensors

        def step(model: Any = model, opt: Any = optimizer, loss: Any = loss, x: Any = x, y: Any = y) -> None:
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()

        steps[mode] = step
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(rounds + 3):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            if i >= 3:
                times[mode].append(time.perf_counter() - start)
    plain_med, plain_best = statistics.median(times["plain"]), min(times["plain"])
    rows: list[list[object]] = []
    for mode, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        ratios = [f"{plain_med / med:.2f}×", f"{plain_best / best:.2f}×"]
        rows.append([config, mode, med * 1e3, best * 1e3, BATCH[config] / med, *ratios])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="54314,92162,1000000")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of noise draws")
    parser.add_argument("--steps", type=int, default=100, help="interleaved rounds of steps (0: skip)")
    parser.add_argument("--configs", default="mlp,cnn")
    args = parser.parse_args(argv)
    sources = {
        "secure (ChaCha20, one draw)": SecureSource(),
        "previous secure (os.urandom, two draws)": UrandomSource(),
        "seeded (torch.Generator)": SeededSource(0),
    }
    rows = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        times: dict[str, list[float]] = {name: [] for name in sources}
        for src in sources.values():
            src.normal((size,), 1.0)  # warm-up (imports, first key)
        for _ in range(args.rounds):
            for name, src in sources.items():
                start = time.perf_counter()
                src.normal((size,), 1.0)
                times[name].append(time.perf_counter() - start)
        seeded = statistics.median(times["seeded (torch.Generator)"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append([f"{size:,}", name, med * 1e3, min(ts) * 1e3, f"{med / seeded:.2f}×"])
    print(f"# Gaussian noise draw, float32, median / best of {args.rounds} interleaved rounds\n")
    print(markdown_table(["coordinates", "source", "median ms", "best ms", "vs seeded"], rows))
    if args.steps > 0:
        print(f"\n# DP-SGD step, median / best of {args.steps} interleaved rounds (3 warm-up)\n")
        rows = [row for config in args.configs.split(",") if config for row in _steps(config, args.steps)]
        header = ["model", "mode", "median ms", "best ms", "ex/s (median)", "vs plain (median)"]
        header.append("vs plain (best)")
        print(markdown_table(header, rows))
    print("\nMachine:\n")
    print(describe_machine("cpu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
