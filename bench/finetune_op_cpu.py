"""Where a MiniLM full fine-tune's DP step spends its CPU, op by op: plain against veil, one process.

    python bench/finetune_op_cpu.py --max-length 40 --batch 25 --steps 3

Every aten op of a step (forward, backward, optimizer step) is timed with the calling thread's CPU
time (``time.thread_time``, one torch thread) and its minor page faults counted (``getrusage``), under
a ``TorchDispatchMode``; the modes' steps are interleaved. Thread CPU time is what a shared machine
does not inflate much (wall times under load are not), and the faults show where fresh memory is
touched. Ops on the noise worker thread (draw-ahead) are not seen: this is the clipping path's
table, not the noise's. Uses bench/finetune.py's model and step (``_step_mode``, ``--fine-tune full``).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import finetune as fb


class OpClock(TorchDispatchMode):
    """Thread CPU seconds, calls and minor faults per (op, input shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        spent = time.thread_time() - start
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        shapes = ",".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))[:60]
        entry = self.seen[(str(func.overloadpacket), shapes)]
        entry[0] += spent
        entry[1] += 1
        entry[2] += faults
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-length", type=int, default=40, help="tokens per tweet")
    p.add_argument("--batch", type=int, default=25)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up)")
    p.add_argument("--modes", default="plain,veil", help="of plain, veil, veil-seeded")
    p.add_argument("--rows", type=int, default=30, help="ops listed per mode")
    args = p.parse_args()
    torch.set_num_threads(1)
    from veil.hf import inspect_folder, load_tokenizer, tokenize

    folder = inspect_folder(fb.minilm_folder())
    texts, labels, _ = fb.tweets()
    train_idx, _ = fb.split(len(texts))
    sub = train_idx[: args.batch]
    x = torch.from_numpy(tokenize(load_tokenizer(folder), [texts[i] for i in sub], args.max_length))
    y = torch.from_numpy(labels[sub])
    modes = args.modes.split(",")
    steps = {}
    for mode in modes:
        (_, step), _ = fb._step_mode(mode, folder, x, y, 0.5, "full")
        step()  # warm-up
        steps[mode] = step
    clocks = {mode: OpClock() for mode in modes}
    for _ in range(args.steps):
        for mode in modes:
            with clocks[mode]:
                steps[mode]()
    n = args.steps
    for mode in modes:
        seen = clocks[mode].seen
        total = sum(v[0] for v in seen.values()) / n
        faults = sum(v[2] for v in seen.values()) / n
        print(f"\n{mode}: op CPU {total:.3f} s a step, {faults:,.0f} minor faults a step\n")
        print("| op | input shapes | ms a step | calls a step | faults a step |")
        print("|---|---|---|---|---|")
        ranked = sorted(seen.items(), key=lambda kv: -kv[1][0])[: args.rows]
        for (name, shapes), (spent, calls, flt) in ranked:
            print(f"| {name} | {shapes} | {spent / n * 1e3:.1f} | {calls // n} | {flt // n:,.0f} |")


if __name__ == "__main__":
    main()
