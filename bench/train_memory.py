"""Peak resident memory of whole ``veil train`` runs (issue 29's memory goal: ≤ 3 GB).

Runs each command in a fresh process (``python -m veil train ...`` with this checkout's ``src``, or ``--src``,
first on the path), samples the child's resident set size from ``/proc/<pid>/status`` every
``--interval`` seconds, and prints per run: the peak (the kernel's ``ru_maxrss`` of the child, the
figure ``/usr/bin/time -v`` prints as "Maximum resident set size"), the RSS after a given share of the
run, wall and CPU seconds, the DP test accuracy and the baseline's from ``report.json``, and the
load average before and after. Linux only (``/proc``).

Usage::

    python bench/train_memory.py                        # Fashion-MNIST at ε = 3, then the digits demo
    python bench/train_memory.py --runs fashion-mnist   # one of them
    python bench/train_memory.py --runs fashion-mnist --extra "--epochs 3 --no-baseline"  # short
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: name -> the ``veil train`` arguments (the run folder and budget registry are added per run).
RUNS = {
    "fashion-mnist": "--dataset fashion-mnist --epsilon 3",
    "digits": "--dataset digits --epsilon 3",  # what `make demo` runs
}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_one(name: str, extra: str, interval: float, folder: Path, src: Path) -> dict[str, object]:
    out, db = folder / f"{name}-run", folder / f"{name}-budget.db"
    args = [*shlex.split(RUNS[name]), *shlex.split(extra), "--out", str(out), "--db", str(db), "--json"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])),
    }
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "veil", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    samples: list[tuple[float, float]] = []
    while proc.poll() is None:
        r = rss_mb(proc.pid)
        if r is not None:
            samples.append((time.monotonic() - t0, r))
        time.sleep(interval)
    stdout = proc.stdout.read() if proc.stdout else ""
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: veil train exited with {proc.returncode}")
    report = json.loads(stdout)
    metrics = report.get("non_private", {})
    return {
        "run": name,
        "args": " ".join(shlex.quote(a) for a in args[:-5]),
        # ru_maxrss of the children is the largest child's peak (kB on Linux); one child here.
        "peak_gb": after.ru_maxrss * 1024 / 1e9,
        "sampled_peak_gb": max((r for _, r in samples), default=0.0) * 2**20 / 1e9,
        "rss_at_quarters_gb": [
            round(samples[min(len(samples) - 1, int(len(samples) * f))][1] * 2**20 / 1e9, 2)
            for f in (0.25, 0.5, 0.75)
        ]
        if samples
        else [],
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "test_accuracy": metrics.get("test_accuracy"),
        "baseline_accuracy": metrics.get("baseline_test_accuracy"),
        "load": f"{load_before:.2f} → {os.getloadavg()[0]:.2f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default="fashion-mnist,digits", help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--extra", default="", help="more veil train arguments for every run")
    parser.add_argument("--src", default=str(ROOT / "src"), help="veil's source folder (another checkout's)")
    parser.add_argument("--interval", type=float, default=1.0, help="RSS sampling period (s)")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="veil-train-memory-") as tmp:
        for name in a.runs.split(","):
            print(json.dumps(run_one(name, a.extra, a.interval, Path(tmp), Path(a.src))), flush=True)


if __name__ == "__main__":
    main()
