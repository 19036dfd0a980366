"""The default DP step's cost, every measurement of issue 27 in one run (for a quiet machine).

Runs, one after the other in fresh processes, and prints each one's markdown with the load average
before and after it and the time it took:

1. ``bench/engine.py`` on the CNN and the MLP, modes plain / veil (secure default) / veil-seeded:
   step and epoch throughput and peak memory, one process per (model, mode, repetition);
2. ``bench/secure_noise.py``: secure against seeded noise draws (the engine models' sizes, 10⁷ and
   10⁸ coordinates) and the MLP and CNN steps, rounds interleaved in one process;
3. ``bench/finetune.py --part throughput --fine-tune full``: MiniLM, every parameter trained
   (position embeddings included), plain against veil and veil-seeded, σ = 1.

Usage::

    python bench/default_step.py            # about 6–8 minutes on 2 idle cores
    python bench/default_step.py --quick    # smoke run (a minute or two)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


#: The recorded run, then the smoke run: (script, arguments); "''" stands for an empty argument.
FULL = (
    ("engine.py", "--configs cnn,mlp --modes plain,veil,veil-seeded --reps 3"),
    (
        "secure_noise.py",
        "--sizes 54314,92162,10000000 --rounds 10 --large 100000000 --large-rounds 3 --steps 30 --no-urandom",
    ),
    ("finetune.py", "--part throughput --fine-tune full --repeats 3 --timed-steps 1"),
)
QUICK = (
    ("engine.py", "--configs cnn,mlp --modes plain,veil,veil-seeded --quick"),
    ("secure_noise.py", "--sizes 92162 --rounds 3 --large '' --steps 3 --no-urandom"),
    ("finetune.py", "--part throughput --fine-tune full --repeats 1 --timed-steps 1"),
)


def commands(quick: bool) -> list[list[str]]:
    """The three benchmark command lines (``quick``: smoke settings)."""
    return [
        [script, *("" if a == "''" else a for a in line.split())]
        for script, line in (QUICK if quick else FULL)
    ]


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke settings")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    failed = 0
    for cmd in commands(args.quick):
        line = " ".join(["python", f"bench/{cmd[0]}", *(a if a else "''" for a in cmd[1:])])
        print(f"\n# `{line}`\n\nload average before: {_load()}\n", flush=True)
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / cmd[0]), *cmd[1:]], check=False)
        failed += proc.returncode != 0
        print(
            f"\nload average after: {_load()}; {time.perf_counter() - began:.0f} s"
            + ("" if proc.returncode == 0 else f"; FAILED (exit {proc.returncode})"),
            flush=True,
        )
    print(f"\nAll three: {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
