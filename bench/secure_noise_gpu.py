"""Secure noise on an accelerator: the torch ChaCha20 keystream and the float32 transform, on the device.

One prepared run for a session that has a GPU (CI and the CPU benches never need one). In order:

1. correctness on the device, before any timing: RFC 8439 block vectors (§2.3.2, A.1 #1 and #2) and
   agreement with the ``cryptography`` package's ChaCha20 on the host for a random key across the
   signed-int32 counter boundary; the same for the ``torch.compile``d block function when
   ``--compile`` is given;
2. moments of 10⁷ secure float32 normals made on the device (mean, variance, 4th moment; z-scores
   printed, |z| < 5.3 expected: each at α = 1e-7);
3. timings, interleaved rounds (median and best; ``torch.cuda.synchronize`` around each draw):
   ``torch.randn`` on the device, ``SecureSource().normal(..., device=dev)`` (device keystream, the
   default there), the host path copied to the device (what the engine did before), and, with
   ``--compile``, the compiled block function inside the same transform;
4. the DP-SGD step of ``bench/engine.py``'s configurations on the device, plain vs veil (secure) vs
   veil-seeded, interleaved (``--steps 0`` skips it).

Usage (exit status 1 if a correctness check fails)::

    python bench/secure_noise_gpu.py                               # sizes 1e6,1e7,1e8
    python bench/secure_noise_gpu.py --compile --rounds 10 --sizes 100000000
    python bench/secure_noise_gpu.py --device cpu --sizes 1000 --rounds 1 --steps 0   # smoke run (tests)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table, timing_rows
from veil.mechanisms import SecureSource, SeededSource, chacha_torch
from veil.mechanisms.box_muller import normal_from_words

RFC = [  # (key, nonce hex, counter, first block hex)
    (bytes(range(32)), "000000090000004a00000000", 1, "10f1e7e4d13b5915500fdd1fa32071c4"),
    (bytes(32), "000000000000000000000000", 0, "76b8e0ada0f13d90405d6ae55386bd28"),
    (bytes(32), "000000000000000000000000", 1, "9f07e7be5551387a98ba977c732d080d"),
]


def _bytes(blocks: torch.Tensor) -> bytes:
    return blocks.cpu().numpy().astype("<i4").tobytes()


def check_keystream(device: torch.device, blocks_fn: Callable[..., torch.Tensor]) -> list[str]:
    """Failures of the RFC vectors and of the agreement with ``cryptography`` on ``device``."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    failures = []
    for key, nonce, counter, head in RFC:
        got = _bytes(blocks_fn(key, bytes.fromhex(nonce), counter, 1, device))[:16].hex()
        if got != head:
            failures.append(f"RFC 8439 vector (counter {counter}): {got} != {head}")
    key, nonce, counter = os.urandom(32), os.urandom(12), (1 << 31) - 100
    ref = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), None).encryptor()
    expected = ref.update(bytes(64 * 1000))
    if _bytes(blocks_fn(key, nonce, counter, 1000, device)) != expected:
        failures.append("disagrees with cryptography's ChaCha20 across counter 2^31")
    return failures


def moments(z: torch.Tensor) -> dict[str, float]:
    """z-scores of the mean, variance and fourth moment of ``z`` against N(0, 1)."""
    x = z.double()
    n = x.numel()
    return {
        "mean": float(x.mean()) * math.sqrt(n),
        "variance": (float((x**2).mean()) - 1.0) / math.sqrt(2.0 / n),
        "fourth": (float((x**4).mean()) - 3.0) / math.sqrt(96.0 / n),
    }


def compiled_blocks() -> Callable[..., torch.Tensor]:
    """``chacha20_blocks`` with its tensor part (the block function) compiled: one compilation, any key."""
    block_function = torch.compile(chacha_torch.block_function, dynamic=True)

    def blocks(key: bytes, nonce: bytes, counter: int, count: int, device: Any) -> torch.Tensor:
        return block_function(chacha_torch.initial_state(key, nonce, counter, count, device))

    return blocks


def compiled_normal(device: torch.device) -> Callable[[int], torch.Tensor]:
    """Secure float32 normals whose keystream comes from the ``torch.compile``d block function."""
    blocks = compiled_blocks()

    def draw(n: int) -> torch.Tensor:
        key, nonce = os.urandom(32), os.urandom(12)
        counter = 0

        def words(k: int) -> torch.Tensor:
            nonlocal counter
            count = (k + 15) // 16
            out = blocks(key, nonce, counter, count, device)
            counter += count
            return out.view(-1)[:k]

        out = torch.empty(n, device=device)
        normal_from_words(out, words, 1.0)
        return out

    return draw


def time_draws(
    sources: dict[str, Callable[[int], Any]], size: int, rounds: int, device: torch.device
) -> list[list[Any]]:
    times: dict[str, list[float]] = {name: [] for name in sources}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for draw in sources.values():
        draw(size)  # warm-up (compilation, first key)
    for _ in range(rounds):
        for name, draw in sources.items():
            sync()
            start = time.perf_counter()
            draw(size)
            sync()
            times[name].append(time.perf_counter() - start)
    return timing_rows(size, times, "torch.randn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="1000000,10000000,100000000")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="interleaved DP-SGD step rounds (0: skip)")
    parser.add_argument("--compile", action="store_true", help="also check and time the compiled keystream")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    failures = check_keystream(device, chacha_torch.chacha20_blocks)
    draw_compiled = compiled_normal(device) if args.compile else None
    if args.compile:
        failures += [f"compiled: {f}" for f in check_keystream(device, compiled_blocks())]
    secure = SecureSource()
    z = secure.normal((10_000_000,), 1.0, device=device)
    print(f"# correctness on {device}\n")
    print(f"keystream checks: {failures or 'all passed'}")
    print(
        "moment z-scores of 10^7 secure normals on the device:",
        {k: round(v, 2) for k, v in moments(z).items()},
    )
    if failures:
        return 1
    seeded = SeededSource(0)
    sources: dict[str, Callable[[int], Any]] = {
        "torch.randn": lambda n: torch.randn(n, device=device),
        "secure, device keystream (default)": lambda n: secure.normal((n,), 1.0, device=device),
        "secure, host keystream + copy": lambda n: secure.normal((n,), 1.0).to(device),
        "seeded (torch.Generator)": lambda n: seeded.normal((n,), 1.0, device=device),
    }
    if draw_compiled is not None:
        sources["secure, compiled device keystream"] = draw_compiled
    rows = [
        row
        for size in (int(s) for s in args.sizes.split(",") if s)
        for row in time_draws(sources, size, args.rounds, device)
    ]
    print(
        f"\n# Gaussian noise draw on {device}, float32, median / best of {args.rounds} interleaved rounds\n"
    )
    print(markdown_table(["coordinates", "source", "median ms", "best ms", "vs torch.randn"], rows))
    if args.steps > 0:
        from secure_noise import step_rows

        print(f"\n# DP-SGD step on {device}, median / best of {args.steps} interleaved rounds\n")
        rows = [
            r
            for config in ("mlp", "cnn")
            for r in step_rows(config, args.steps, ("plain", "veil", "veil-seeded"), device)
        ]
        header = [
            "model",
            "mode",
            "median ms",
            "best ms",
            "ex/s (median)",
            "vs plain (median)",
            "vs plain (best)",
            "host CPU ms (median)",
            "host CPU vs plain (median)",
        ]
        print(markdown_table(header, rows))
    print("\nMachine:\n")
    print(describe_machine(str(device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
