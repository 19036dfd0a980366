"""Shared helpers for the benchmarks: a description of the machine, timing, peak memory, tables."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_description(device: str = "cpu") -> dict[str, Any]:
    """CPU, cores, memory, accelerator, and versions: enough to judge whether two runs compare."""
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores (os.cpu_count)": os.cpu_count(),
        "usable cores (affinity)": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "opacus": _version("opacus"),
        "veil": _version("veil"),
        "load average (1, 5, 15 min)": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory (GiB)"] = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError):
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def describe_machine(device: str = "cpu") -> str:
    """The machine description as a markdown bullet list."""
    return "\n".join(f"- {k}: {v}" for k, v in machine_description(device).items())


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """High-water mark of the resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux ≥ 4.0 via /proc/self/clear_refs); True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_bytes() -> int:
    """VmHWM from /proc/self/status (honours :func:`reset_peak_rss`); falls back to getrusage."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return peak_rss_bytes()


class Stopwatch:
    """``with Stopwatch() as t: ...; t.seconds``; synchronises CUDA when asked."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._start


def timing_rows(size: int, times: dict[str, list[float]], baseline: str) -> list[list[object]]:
    """One table row per timed source of a draw of ``size``: median and best in ms, and the median's
    ratio to ``baseline``'s median."""
    import statistics

    base = statistics.median(times[baseline])
    rows: list[list[object]] = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append([f"{size:,}", name, med * 1e3, min(ts) * 1e3, f"{med / base:.2f}×"])
    return rows


def fixed_batch_drawn(loader: Any) -> None:
    """Tell veil's private loader (``make_private``'s) that the bench's fixed batch stands for a batch
    it drew, before a timed step on that batch: the optimizer takes one step per batch handed out
    (``veil.sampling.StepSignal``). Timing only: such a loop is no DP run (the same rows every step).
    Other loaders (plain PyTorch, Opacus) have no signal and are left alone."""
    signal = getattr(loader, "signal", None)
    if signal is not None:
        signal.hand_out(first=True, last=True)
