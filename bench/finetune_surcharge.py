"""Where the DP step's surcharge on a MiniLM full fine-tune sits: plain vs veil (secure) vs veil-seeded
step time at several batch sizes, interleaved, so the part paid once per logical step (the noise for
every parameter) can be told from the part that grows with the batch (the clipping rule's work).

    python bench/finetune_surcharge.py --max-length 64 --batches 25,100
    python bench/finetune_surcharge.py --max-length 40 --batches 25,100 --levers

Uses bench/finetune.py's model and step (``_step_mode``, ``--fine-tune full``: σ = 1, C = 1).
``--levers`` adds a column ``veil-before``: the same secure DP step with the levers of the fourth
issue-27 session (2026-12-01/02 night) switched off around each of its steps (the host noise
transform of main 0cf85ea, and the clipped sum and grid applied by torch ops after the draw instead
of chunk by chunk inside it: ``legacy_noise.release_of_before``), so before and after are timed
interleaved.
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-length", type=int, default=64, help="tokens per tweet")
    p.add_argument("--batches", default="25,100", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=4, help="interleaved repetitions (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levers", action="store_true", help="also time veil with this session's levers off")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from veil.hf import inspect_folder, load_tokenizer, tokenize

    folder = inspect_folder(fb.minilm_folder())
    texts, labels, _ = fb.tweets()
    train_idx, _ = fb.split(len(texts))
    tok = load_tokenizer(folder)
    print(fb.describe_machine(), "\n")
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
