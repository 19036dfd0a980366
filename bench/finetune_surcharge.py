"""Where the DP step's surcharge on a MiniLM full fine-tune sits: plain vs veil (secure) vs veil-seeded
step time at several batch sizes, interleaved, so the part paid once per logical step (the noise for
every parameter) can be told from the part that grows with the batch (the clipping rule's work).

    python bench/finetune_surcharge.py --max-length 64 --batches 25,100
    python bench/finetune_surcharge.py --max-length 40 --batches 25,100 --levers
    python bench/finetune_surcharge.py --max-length 40 --batches 25,64 --memory

``--memory`` measures instead the peak resident memory a step adds, per mode in a fresh process (the
model built and the batch tokenized first; then a warm-up and two steps): the kernel's high-water
mark (``VmHWM``, reset before the steps) minus the resident size before them, as ``bench/engine.py``
reads it for the CNN and the MLP.

Uses bench/finetune.py's model and step (``_step_mode``, ``--fine-tune full``: σ = 1, C = 1).
``--levers`` adds a column ``veil-before``: the same secure DP step with the levers of the fourth
issue-27 session (2026-12-01/02 night) switched off around each of its steps (the host noise
transform of main 0cf85ea, and the clipped sum and grid applied by torch ops after the draw instead
of chunk by chunk inside it: ``legacy_noise.release_of_before``), so before and after are timed
interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import finetune as fb


def _before(step: Callable[[], None]) -> Callable[[], None]:
    from legacy_noise import release_of_before

    def run() -> None:
        with release_of_before():
            step()

    return run


def _step_memory(step: Callable[[], None]) -> dict[str, int]:
    """Resident bytes before the steps, and the high-water mark over a warm-up and two steps."""
    from common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss

    base = current_rss_bytes()
    reset_peak_rss()
    for _ in range(3):
        step()
    return {"base": base, "peak": peak_rss_since_reset_bytes()}


def _memory_table(args: argparse.Namespace) -> None:
    """One fresh process per (batch, mode): the step's extra peak memory, and against plain's."""
    print("| batch | mode | resident before MiB | peak MiB | step adds MiB | adds vs plain | peak vs plain |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        got = {}
        for mode in ("plain", "veil", "veil-seeded"):
            cmd = [sys.executable, __file__, "--one", f"{mode},{batch}", "--max-length", str(args.max_length)]
            cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got[mode] = json.loads(out.strip().splitlines()[-1])
        plain = got["plain"]
        for mode, m in got.items():
            adds, mib = m["peak"] - m["base"], 1 << 20
            print(
                f"| {batch} | {mode} | {m['base'] / mib:,.0f} | {m['peak'] / mib:,.0f} | {adds / mib:,.0f} | "
                f"{adds / max(plain['peak'] - plain['base'], 1):.2f}× | {m['peak'] / plain['peak']:.2f}× |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-length", type=int, default=64, help="tokens per tweet")
    p.add_argument("--batches", default="25,100", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=4, help="interleaved repetitions (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levers", action="store_true", help="also time veil with this session's levers off")
    p.add_argument("--memory", action="store_true", help="peak memory a step adds, one process per mode")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # "mode,batch": the memory child
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from veil.hf import inspect_folder, load_tokenizer, tokenize

    folder = inspect_folder(fb.minilm_folder())
    texts, labels, _ = fb.tweets()
    train_idx, _ = fb.split(len(texts))
    tok = load_tokenizer(folder)
    if args.one:
        mode, size = args.one.split(",")
        sub = train_idx[: int(size)]
        x = torch.from_numpy(tokenize(tok, [texts[i] for i in sub], args.max_length))
        (_, step), _ = fb._step_mode(mode, folder, x, torch.from_numpy(labels[sub]), 0.5, "full")
        print(json.dumps(_step_memory(step)))
        return
    print(fb.describe_machine(), "\n")
    if args.memory:
        _memory_table(args)
        return
    before = ["veil-before"] if args.levers else []
    extra = "".join(f" {m} s | {m} vs plain |" for m in before)
    head = "| batch | plain s | veil s | veil-seeded s | veil vs plain | seeded vs plain | surcharge s |"
    print(head + extra)
    print("|---" * (7 + 2 * len(before)) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        sub = train_idx[:batch]
        x = torch.from_numpy(tokenize(tok, [texts[i] for i in sub], args.max_length))
        y = torch.from_numpy(labels[sub])
        steps = {}
        for mode in ("plain", "veil", "veil-seeded", *before):
            (_, step), _ = fb._step_mode("veil" if mode in before else mode, folder, x, y, 0.5, "full")
            step = _before(step) if mode in before else step
            step()  # warm-up
            steps[mode] = step
        times: dict[str, list[float]] = {m: [] for m in steps}
        for _ in range(args.repeats):
            for mode, step in steps.items():
                start = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - start)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(
            f"| {batch} | {med['plain']:.3f} | {med['veil']:.3f} | {med['veil-seeded']:.3f} | "
            f"{med['plain'] / med['veil']:.2f}× | {med['plain'] / med['veil-seeded']:.2f}× | "
            f"{med['veil'] - med['plain']:.3f} |"
            + "".join(f" {med[m]:.3f} | {med['plain'] / med[m]:.2f}× |" for m in before),
            flush=True,
        )


if __name__ == "__main__":
    main()
