"""The cost of secure noise, measured so that a loaded machine still gives usable ratios.

1. One Gaussian noise draw: each source draws ``N(0, 1)`` float32 noise of the sizes below (the CNN
   and MLP of ``bench/engine.py`` need 54,314 and 92,162 coordinates a step): secure (ChaCha20
   keystream, the default), the previous secure sampler (``os.urandom``, two draws; see
   ``legacy_noise.py``) and seeded (``torch.Generator``'s ``normal_``: what ``torch.randn`` runs,
   so "vs seeded" is the ratio to ``torch.randn``). 10⁷ coordinates with the others; 10⁸ (a
   full fine-tune's worth) with ``--large-rounds`` rounds and without the previous sampler.
2. One DP-SGD step of ``bench/engine.py``'s MLP and CNN (batch 256, σ = 1, C = 1, fixed batch) in
   the modes plain, veil (secure, the default), veil-before (the same engine with the secure release
   of main 0cf85ea: its host transform, the clipped sum and grid applied by torch ops after the draw;
   ``legacy_noise.release_of_before``), veil-at-step (the default engine with the small-group reserve
   of ``veil.noise_ahead`` switched off: every step draws its noise at the step, as before the
   reserve), veil-conv-before (the default engine with every convolution's per-sample weight
   gradients from the grouped convolution of main 863f2e4, ``veil.clipping.rules.conv``'s patch matmul
   off), veil-urandom (the previous secure sampler) and veil-seeded. Each step is timed in wall time
   and in process CPU time (``time.process_time``: what a loaded machine disturbs least, and with
   ``--threads 1`` the step's own work; with two threads it also counts threads spinning in wait).

Everything runs in one process with rounds interleaved (one draw, or one step, of every source or
mode per round), so load drift hits every source alike. Reported: the median and the best of the
rounds, and each against the seeded draw / the plain step. ``bench/engine.py`` (one process per
configuration, whole epochs, peak memory) is the reference on an idle machine; this script is the
one to trust when the machine is shared.

Usage::

    python bench/secure_noise.py                # 54314 … 10⁷: 30 draw rounds; 10⁸: 3; 100 steps
    python bench/secure_noise.py --rounds 100 --sizes 92162 --steps 0
    python bench/secure_noise.py --sizes '' --large '' --configs cnn --steps 100 \
        --modes plain,veil,veil-conv-before,veil-seeded --threads 1   # the CNN's clipping path
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, fixed_batch_drawn, markdown_table, timing_rows
from legacy_noise import UrandomSource, release_of_before
from veil.mechanisms import SecureSource, SeededSource

MODES = ("plain", "veil", "veil-before", "veil-at-step", "veil-conv-before", "veil-urandom", "veil-seeded")
BASELINE = "seeded (torch.Generator)"  # torch.randn's sampler, on a generator of its own


def step_rows(
    config: str, rounds: int, modes: tuple[str, ...] = MODES, device: Any = "cpu"
) -> list[list[object]]:
    """Rows of the step table for one model: each mode's step timed once per round, rounds interleaved."""
    import torch

    from engine import BATCH, build, make_mode

    torch.manual_seed(0)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    steps = {}
    for mode in modes:
        model, data, loss = build(config)
        engine_mode = "veil" if mode in ("veil-before", "veil-at-step", "veil-conv-before") else mode
        model, optimizer, loader, loss = make_mode(
            engine_mode, model.to(dev), data(BATCH[config]), loss, BATCH[config]
        )
        x, y = (t.to(dev) for t in data(BATCH[config]).tensors)
        # veil-before: the default engine with the secure release of main 0cf85ea (legacy_noise.py)
        context = {
            "veil-before": release_of_before,
            "veil-at-step": _no_reserve,
            "veil-conv-before": _conv_before,
        }.get(mode, contextlib.nullcontext)

        def step(
            model: Any = model,
            opt: Any = optimizer,
            loss: Any = loss,
            x: Any = x,
            y: Any = y,
            ctx: Any = context,
            loader: Any = loader,
        ) -> None:
            with ctx():
                fixed_batch_drawn(loader)
                opt.zero_grad()
                loss(model(x), y).backward()
                opt.step()

        steps[mode] = step
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(rounds + 3):
        for mode, step in steps.items():
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            sync()
            if i >= 3:
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - cpu_start)
    plain_med, plain_best = statistics.median(times["plain"]), min(times["plain"])
    plain_cpu = statistics.median(cpu["plain"])
    rows: list[list[object]] = []
    for mode, ts in times.items():
        med, best, cpu_med = statistics.median(ts), min(ts), statistics.median(cpu[mode])
        ratios = [f"{plain_med / med:.2f}×", f"{plain_best / best:.2f}×"]
        cpu_cols = [cpu_med * 1e3, f"{plain_cpu / cpu_med:.2f}×"]
        rows.append([config, mode, med * 1e3, best * 1e3, BATCH[config] / med, *ratios, *cpu_cols])
    return rows


@contextlib.contextmanager
def _no_reserve() -> Any:
    """The default engine drawing every step's noise at the step (``veil.noise_ahead``'s reserve off)."""
    from veil import noise_ahead

    saved = noise_ahead.RESERVE_COORDINATES
    noise_ahead.RESERVE_COORDINATES = 0
    try:
        yield
    finally:
        noise_ahead.RESERVE_COORDINATES = saved


@contextlib.contextmanager
def _conv_before() -> Any:
    """The default engine with convolutions' per-sample weight gradients from the grouped convolution
    (main 863f2e4's only materialised form): ``veil.clipping.rules.conv.patches_fit`` answers no."""
    from veil.clipping.rules import conv

    saved = conv.patches_fit
    conv.patches_fit = lambda rows, c_out: False
    try:
        yield
    finally:
        conv.patches_fit = saved


def draw_rows(sources: dict[str, Any], size: int, rounds: int) -> list[list[object]]:
    """Rows of the draw table for one size: each source's draw timed once per round, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in sources}
    for src in sources.values():
        src.normal((size,), 1.0)  # warm-up (imports, first key)
    for _ in range(rounds):
        for name, src in sources.items():
            start = time.perf_counter()
            src.normal((size,), 1.0)
            times[name].append(time.perf_counter() - start)
    return timing_rows(size, times, BASELINE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="54314,92162,1000000,10000000")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of noise draws")
    parser.add_argument(
        "--large", default="100000000", help="sizes drawn with --large-rounds rounds only (empty: none)"
    )
    parser.add_argument("--large-rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="interleaved rounds of steps (0: skip)")
    parser.add_argument("--configs", default="mlp,cnn")
    parser.add_argument("--no-urandom", action="store_true", help="leave out the previous secure sampler")
    parser.add_argument("--modes", default=",".join(MODES), help="step modes (plain is always run)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    load_before = _load()
    sources: dict[str, Any] = {
        "secure (ChaCha20, one draw)": SecureSource(),
        "previous secure (os.urandom, two draws)": UrandomSource(),
        BASELINE: SeededSource(0),
    }
    if args.no_urandom:
        del sources["previous secure (os.urandom, two draws)"]
    rows = [row for size in _sizes(args.sizes) for row in draw_rows(sources, size, args.rounds)]
    large = {k: v for k, v in sources.items() if "os.urandom" not in k}  # the old sampler: minutes
    rows += [row for size in _sizes(args.large) for row in draw_rows(large, size, args.large_rounds)]
    print(f"# Gaussian noise draw, float32, median / best of {args.rounds} interleaved rounds")
    print(f"({args.large_rounds} rounds for {args.large or 'no'} coordinates)\n")
    print(markdown_table(["coordinates", "source", "median ms", "best ms", "vs seeded"], rows))
    if args.steps > 0:
        print(f"\n# DP-SGD step, median / best of {args.steps} interleaved rounds (3 warm-up)\n")
        chosen = {m for m in args.modes.split(",") if m} | {"plain"}
        unknown = chosen - set(MODES)
        if unknown:
            raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {MODES}")
        modes = tuple(m for m in MODES if m in chosen and not (args.no_urandom and m == "veil-urandom"))
        configs = [c for c in args.configs.split(",") if c]
        rows = [row for config in configs for row in step_rows(config, args.steps, modes)]
        header = ["model", "mode", "median ms", "best ms", "ex/s (median)", "vs plain (median)"]
        header += ["vs plain (best)", "CPU ms (median)", "CPU vs plain (median)"]
        print(markdown_table(header, rows))
    print(f"\nLoad average (1, 5, 15 min) before: {load_before}; after: {_load()}")
    print("\nMachine:\n")
    print(describe_machine("cpu"))
    return 0


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
