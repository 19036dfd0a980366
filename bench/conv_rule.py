"""The convolution rule's per-sample weight and bias gradients: its two materialised forms against the
plain (summed) weight gradient, timed interleaved on the same tensors.

For each shape (batch, C_in → C_out, 3×3 kernel, padding 1 unless the SimpleCNN's valid 28×28): the
grouped convolution plus a separate bias sum (``per_sample_weight``: main 863f2e4's only form), the
batched matmul over the input patches with the bias as its last row (``per_sample_weight_and_bias``),
and ``torch.ops.aten.convolution_backward`` for the weight and bias (what a plain step computes: the
sum over the batch). ``rule uses`` says which form ``veil.clipping.rules.conv`` picks (``patches_fit``:
the patches no larger than the output gradient). Reported: median / best wall milliseconds of the
rounds and the median process CPU milliseconds; the two per-sample forms are checked to agree.

Usage::

    python bench/conv_rule.py                 # torch's default threads, 20 rounds
    python bench/conv_rule.py --threads 1 --rounds 40
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

from common import describe_machine, markdown_table
from veil.clipping.rules.conv import patches_fit, per_sample_weight, per_sample_weight_and_bias

#: (batch, C_in, C_out, side, padding): the SimpleCNN's first layer, then wider and deeper layers.
SHAPES = (
    (256, 1, 32, 28, 0),
    (64, 4, 64, 28, 1),
    (256, 1, 8, 28, 1),
    (256, 3, 16, 32, 1),
    (256, 16, 16, 14, 1),
    (256, 8, 8, 28, 1),
)


def time_shape(batch: int, c_in: int, c_out: int, side: int, padding: int, rounds: int) -> list[list[object]]:
    """Rows for one shape: each form timed once per round, rounds interleaved."""
    conv = nn.Conv2d(c_in, c_out, 3, padding=padding)
    x = torch.randn(batch, c_in, side, side)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    args = ([c_out], [1, 1], [padding, padding], [1, 1], False, [0, 0], 1, [False, True, True])

    def grouped() -> Any:
        return per_sample_weight(conv, x, g), g.sum(dim=(2, 3))

    def patches() -> Any:
        return per_sample_weight_and_bias(conv, x, g, True)

    def plain() -> Any:
        return torch.ops.aten.convolution_backward(g, x, conv.weight, *args)

    (w_grouped, b_grouped), (w_patches, b_patches) = grouped(), patches()
    scale = float(w_grouped.abs().max()) + float(b_grouped.abs().max())
    assert b_patches is not None
    error = max(float((w_grouped - w_patches).abs().max()), float((b_grouped - b_patches).abs().max()))
    assert error <= 1e-4 * scale, (error, scale)
    forms = {
        "grouped convolution + bias sum": grouped,
        "patch matmul": patches,
        "plain weight backward": plain,
    }
    wall: dict[str, list[float]] = {name: [] for name in forms}
    cpu: dict[str, list[float]] = {name: [] for name in forms}
    for i in range(rounds + 2):
        for name, form in forms.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            form()
            if i >= 2:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
    d = c_in * 9
    picked = "patch matmul" if patches_fit(d + 1, c_out) else "grouped convolution"
    shape = f"{batch} × {c_in}→{c_out}, {side}×{side}"
    return [
        [shape, picked, name, *(ms * 1e3 for ms in (median(wall[name]), min(wall[name]), median(cpu[name])))]
        for name in forms
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = [row for shape in SHAPES[: args.shapes] for row in time_shape(*shape, args.rounds)]
    header = ["layer (batch × channels, input)", "rule uses", "form", "median ms", "best ms"]
    header.append("CPU ms (median)")
    print(f"# Per-sample conv weight + bias gradients, {args.rounds} interleaved rounds\n")
    print(markdown_table(header, rows))
    print(f"\nLoad average (1, 5, 15 min) before: {load}; after: ", end="")
    print(" ".join(f"{v:.2f}" for v in os.getloadavg()))
    print("\nMachine:\n")
    print(describe_machine("cpu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
