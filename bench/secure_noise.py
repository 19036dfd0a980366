"""Time of one Gaussian noise draw: secure (ChaCha20 keystream), the previous secure sampler, seeded.

Each source draws ``N(0, 1)`` float32 noise of the sizes below (the CNN and MLP of
``bench/engine.py`` need 54,314 and 92,162 coordinates a step) in one process, rounds interleaved
so load drift hits every source alike. Reported: the median and the best of the rounds, in
milliseconds per draw, and each source against the seeded one (``torch.Generator``).

Usage::

    python bench/secure_noise.py                # sizes 54314,92162,1000000, 30 rounds
    python bench/secure_noise.py --rounds 100 --sizes 92162
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table
from legacy_noise import UrandomSource
from veil.mechanisms import SecureSource, SeededSource


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="54314,92162,1000000")
    parser.add_argument("--rounds", type=int, default=30)
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
    print("\nMachine:\n")
    print(describe_machine("cpu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
