"""Load time and peak memory of the table readers (CSV and Parquet), from file to encoded float32 matrix.

    python bench/tables.py                          # 10^5, 10^6, 10^7 rows × 20 numeric columns
    python bench/tables.py --rows 100000 --legacy   # also the old pure-Python CSV reader, for comparison
    python bench/tables.py --train 1000000          # DP training examples/s (veil train) on that table
    python bench/tables.py --stream 10000000        # DP training streamed from a 10^7-row Parquet file,
                                                    # beside in-memory training on 10^6 rows
    python bench/tables.py --stream-read 1000000,10000000 --batch 10000 --stream-rows 100000
                                                    # the streaming read path alone, same B and budget

Files are generated into ``--dir`` (default /tmp/veil-bench-tables; deleted afterwards unless --keep):
N rows × 20 numeric columns (values printed with 6 significant digits) and a 0/1 label, as CSV and as
Parquet (row groups of 1M rows). Each load runs in a fresh subprocess, which reads its resident memory
after the imports (baseline) and its high-water mark after the load: "peak − baseline" is the memory the
load itself took, compared with the size of the float32 result (N × 20 × 4 bytes).

What is timed is the whole path a training run takes, :func:`veil.tables.load_table` with the reviewed
schema: typed columnar reading in batches (:func:`veil.tables.sources.iter_source`) and encoding of each
batch into the preallocated float32 feature matrix (clip, scale, class indices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import describe_machine, markdown_table

FEATURES = 20


def schema_text() -> str:
    lines = ["reviewed = true", ""]
    for j in range(FEATURES):
        lines += [f"[columns.f{j}]", 'type = "numeric"', "bounds = [-10.0, 10.0]", 'missing = "error"', ""]
    lines += ["[columns.label]", 'role = "target"', 'classes = ["0", "1"]']
    return "\n".join(lines) + "\n"


def generate(folder: Path, rows: int) -> tuple[Path, Path]:
    """Write the N-row CSV and Parquet files (in chunks of 10^6 rows, so generation stays small)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    csv_path, pq_path = folder / f"t{rows}.csv", folder / f"t{rows}.parquet"
    if csv_path.exists() and pq_path.exists():
        return csv_path, pq_path
    rng = np.random.default_rng(rows)
    chunk = 1_000_000
    writer = None
    with open(csv_path, "wb") as fh:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            x = rng.normal(0, 3, (n, FEATURES)).astype(np.float32)
            cols = {f"f{j}": pa.array(np.round(x[:, j], 4)) for j in range(FEATURES)}
            cols["label"] = pa.array((x[:, 0] + x[:, 1] > 0).astype(np.int64))
            table = pa.table(cols)
            pcsv.write_csv(table, fh, write_options=pcsv.WriteOptions(include_header=start == 0))
            if writer is None:
                writer = pq.ParquetWriter(pq_path, table.schema)
            writer.write_table(table, row_group_size=chunk)
    assert writer is not None
    writer.close()
    return csv_path, pq_path


MEASURE = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
kind, path, schema_path = sys.argv[1:4]
if kind == "legacy":
    from veil.data.tabular import load_user
else:
    import pyarrow, pyarrow.csv, pyarrow.parquet  # noqa: F401
    from veil.tables import load_table
    from veil.tables.schema import load_schema
base = current_rss_bytes()
reset_peak_rss()
t = time.perf_counter()
if kind == "legacy":
    ds = load_user("csv", path, target="label", test_fraction=0.2, seed=0)
    shape = [ds.n_train + ds.n_test, ds.x_train.shape[1]]
else:
    enc = load_table(f"{kind}:{path}", load_schema(schema_path))
    shape = list(enc.x.shape)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "base": base, "peak": peak_rss_since_reset_bytes(), "shape": shape}))
"""


def measure(kind: str, path: Path, schema: Path) -> dict[str, float]:
    bench_dir = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, kind, str(path), str(schema), bench_dir],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def train_speed(folder: Path, rows: int, epsilon: float, epochs: int | None = None) -> None:
    """``veil train`` on the N-row CSV with its reviewed schema: DP examples/s and the baseline's cost.

    Timings in this process: the load (read + encode), a warm-up run (discarded: imports and other
    one-time costs), a run without the baseline and a run with it. DP-SGD examples/s = planned
    epochs × training rows / (run without baseline − load); the baseline's cost is the difference of
    the two runs. Defaults of the table preset (50 epochs,
    expected batch N/2, logistic regression). Each timing is given in wall-clock seconds and in CPU
    seconds of this process (all threads): on a shared machine the second is the steadier one.
    """
    import tempfile

    from veil import train
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    csv_path, _ = generate(folder, rows)
    schema = folder / "schema.toml"
    t, c = time.perf_counter(), time.process_time()
    load_table(f"csv:{csv_path}", load_schema(schema))
    load_s, load_cpu = time.perf_counter() - t, time.process_time() - c
    results = []
    for baseline in (False, False, True):  # the first run pays the one-time costs (imports): discarded
        with tempfile.TemporaryDirectory() as tmp:
            t, c = time.perf_counter(), time.process_time()
            report = train(
                {
                    "dataset": f"csv:{csv_path}",
                    "table_schema": str(schema),
                    "epsilon": epsilon,
                    "delta": 1e-7,
                    "baseline": baseline,
                    "out": str(Path(tmp) / "run"),
                    **({"epochs": epochs} if epochs else {}),
                },
                progress=False,
            )
            results.append((time.perf_counter() - t, time.process_time() - c, report))
    (dp_s, dp_cpu, dp), (both_s, both_cpu, with_base) = results[1:]
    examples = dp.epochs * dp.dataset.n_train
    header = [
        "clock",
        "load s",
        "run s (no baseline)",
        "DP examples/s",
        "baseline s",
        "run s (with baseline)",
    ]
    clocks = (("wall", load_s, dp_s, both_s), ("CPU", load_cpu, dp_cpu, both_cpu))
    table = [
        [name, round(load, 1), round(run, 1), round(examples / max(run - load, 1e-9)), round(both - run, 1),
         round(both, 1)]
        for name, load, run, both in clocks
    ]  # fmt: skip
    print(markdown_table(header, table))
    print(
        f"\n{rows} rows ({dp.dataset.n_train} training), {dp.steps} steps of expected batch {dp.batch_size}, "
        f"ε = {dp.epsilon_spent:.3f} (target {epsilon:g}), δ = 1e-7; "
        f"DP test accuracy {dp.test_accuracy:.4f}, "
        f"baseline {with_base.baseline_test_accuracy:.4f}"
    )


def generate_parquet(folder: Path, rows: int, row_group: int) -> Path:
    """The N-row table of :func:`generate` as Parquet only, in row groups of ``row_group`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"s{rows}.parquet"
    rng = np.random.default_rng(rows)
    writer = None
    for start in range(0, rows, 1_000_000):
        n = min(1_000_000, rows - start)
        x = rng.normal(0, 3, (n, FEATURES)).astype(np.float32)
        cols = {f"f{j}": pa.array(np.round(x[:, j], 4)) for j in range(FEATURES)}
        cols["label"] = pa.array((x[:, 0] + x[:, 1] > 0).astype(np.int64))
        table = pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group)
    assert writer is not None
    writer.close()
    return path


TRAIN_MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
import pyarrow.parquet, torch  # noqa: F401  (imported before the baseline memory is read)
import veil.pipeline.data as pdata
import veil.training.execute as vt
from veil import train
config = json.loads(sys.argv[2])
timing, peaks = {}, {}
real_load, real_start, real_steps = pdata.load_data, vt.start, vt.train_steps
def load(cfg, **kwargs):  # the load (in memory) or the scan (streamed)
    t = time.perf_counter()
    data = real_load(cfg, **kwargs)
    timing["load"] = time.perf_counter() - t
    peaks["load"] = peak_rss_since_reset_bytes()
    return data
def start(*args, **kwargs):  # from here to the last step: the training loop's own high-water mark
    peaks["before_loop"] = peak_rss_since_reset_bytes()
    reset_peak_rss()
    return real_start(*args, **kwargs)
def steps(*args, **kwargs):
    out = real_steps(*args, **kwargs)
    peaks["loop"] = peak_rss_since_reset_bytes()
    reset_peak_rss()
    return out
pdata.load_data, vt.start, vt.train_steps = load, start, steps
base = current_rss_bytes()
reset_peak_rss()
t, c = time.perf_counter(), time.process_time()
r = train(config, progress=False)
peaks["after_loop"] = peak_rss_since_reset_bytes()
print(json.dumps({"seconds": time.perf_counter() - t, "cpu": time.process_time() - c, "load": timing["load"],
                  "base": base, "peak": max(peaks.values()), "load_peak": peaks["load"],
                  "loop_peak": peaks["loop"], "steps": r.steps, "batch": r.batch_size,
                  "n_train": r.dataset.n_train, "eps": r.epsilon_spent, "acc": r.test_accuracy,
                  "streaming": r.streaming}))
"""


def train_measured(config: dict[str, Any]) -> dict[str, Any]:
    """One ``veil.train`` in a fresh process: times, resident memory, the report's figures."""
    bench_dir = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", TRAIN_MEASURE, bench_dir, json.dumps(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def stream_speed(
    folder: Path,
    rows: int,
    memory_rows: int,
    batch: int,
    epochs: int,
    budget: int,
    row_group: int,
    physical: int | None = None,
) -> None:
    """DP training streamed from an N-row Parquet file (``--stream``) beside in-memory training on a
    smaller one, at the same sampling rate q = B/N_train, epochs, ε = 3 and δ = 1e-8, secure randomness,
    no baseline. Each run in a fresh process: wall and CPU seconds, the load (in-memory: read + encode;
    streamed: the scan that encodes and splits every row once), DP examples/s = steps × B / (run − load),
    and the resident-memory high-water mark (peak) and its rise over the imports (peak − base), also
    split by phase: during the load or scan, and during the training loop alone (from building the
    private model to the last step; in memory, the table is resident throughout).
    """
    results = []
    for mode, n in (("in memory", memory_rows), ("streamed", memory_rows), ("streamed", rows)):
        t = time.perf_counter()
        path = folder / f"s{n}.parquet"
        if not path.exists():
            path = generate_parquet(folder, n, row_group)
        print(f"generated {n} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        b = max(1, round(batch * n / rows))  # the same q at both sizes
        config: dict[str, Any] = {
            "dataset": f"parquet:{path}",
            "table_schema": str(folder / "schema.toml"),
            "epsilon": 3.0,
            "delta": 1e-8,
            "epochs": epochs,
            "batch_size": b,
            "baseline": False,
            "out": str(folder / f"run-{n}"),
            **({"physical_batch_size": physical} if physical else {}),
            # the budget scaled like B: the same steps per window at both sizes
            **({"stream": True, "stream_rows": round(budget * n / rows)} if mode == "streamed" else {}),
        }
        m = train_measured(config)
        if mode == "streamed":
            path.unlink()
        shutil.rmtree(folder / f"run-{n}", ignore_errors=True)
        steps, seconds, load = int(m["steps"]), float(m["seconds"]), float(m["load"])
        info = m["streaming"] or {}
        results.append(
            [mode, n, m["n_train"], b, steps, round(load, 1), round(seconds, 1), round(m["cpu"], 1),
             round(steps * b / max(seconds - load, 1e-9)), round(m["peak"] / 1e6),
             round((m["load_peak"] - m["base"]) / 1e6), round((m["loop_peak"] - m["base"]) / 1e6),
             round((m["peak"] - m["base"]) / 1e6), round(n * (FEATURES * 4 + 8) / 1e6),
             info.get("windows", "–"), round(m["acc"], 4)]
        )  # fmt: skip
        print(results[-1], m["streaming"], file=sys.stderr)
    header = ["mode", "rows", "train rows", "B", "steps", "load/scan s", "run s", "CPU s", "DP examples/s",
              "peak RSS MB", "load peak − base MB", "loop peak − base MB", "peak − base MB",
              "encoded table MB", "windows", "DP test acc"]  # fmt: skip
    print(markdown_table(header, results))
    print(f"\nrow groups of {row_group} rows; --stream-rows {budget} at {rows} rows, scaled with N;")
    print(f"{epochs} epoch(s); physical batch size {physical or 'none'}")


READ_MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from common import current_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss
import pyarrow.parquet, torch  # noqa: F401
from veil.mechanisms.rng import make_source
from veil.tables.encoder import TableEncoder
from veil.tables.sampler import ChunkedPoissonSampler
from veil.tables.schema import load_schema
from veil.tables.stream import ParquetRows, WindowedSampler, scan_parquet
path, schema, batch, budget, steps = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
encoder = TableEncoder(load_schema(schema))
base = current_rss_bytes()
reset_peak_rss()
t = time.perf_counter()
scan = scan_parquet(path, encoder, 0.2, 0)
scan_s, scan_peak = time.perf_counter() - t, peak_rss_since_reset_bytes()
rows = ParquetRows(path, encoder, scan.positions)
sampler = ChunkedPoissonSampler(len(rows), batch / len(rows), steps, make_source(True))
t = time.perf_counter()
for indices, _ in WindowedSampler(sampler, rows, budget).logical_batches():
    rows.fetch(indices)
print(json.dumps({"scan": scan_s, "steps_s": time.perf_counter() - t, "base": base, "scan_peak": scan_peak,
                  "peak": peak_rss_since_reset_bytes(), "windows": rows.stats.windows,
                  "peak_rows": rows.stats.peak_rows}))
"""


def stream_read(folder: Path, sizes: list[int], batch: int, budget: int, row_group: int, steps: int) -> None:
    """The streaming read path alone (no model): the scan, then ``steps`` Poisson batches of expected
    size ``batch`` read window by window (``budget`` rows), at each table size, same B and budget; in a
    fresh process each: what streaming itself holds as N grows."""
    bench_dir = str(Path(__file__).resolve().parent)
    results = []
    for n in sizes:
        path = generate_parquet(folder, n, row_group)
        done = subprocess.run(
            [sys.executable, "-c", READ_MEASURE, bench_dir, str(path), str(folder / "schema.toml"),
             str(batch), str(budget), str(steps)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        path.unlink()
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        m = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(
            [n, batch, budget, round(m["scan"], 1), round((m["scan_peak"] - m["base"]) / 1e6),
             steps, round(m["steps_s"], 1), m["windows"], m["peak_rows"],
             round((max(m["peak"], m["scan_peak"]) - m["base"]) / 1e6), round(n * (FEATURES * 4 + 8) / 1e6)]
        )  # fmt: skip
        print(results[-1], file=sys.stderr)
    header = ["rows", "B", "--stream-rows", "scan s", "scan peak − base MB", "steps", "steps s", "windows",
              "peak rows held", "peak − base MB", "encoded table MB"]  # fmt: skip
    print(markdown_table(header, results))


def _timed_run(args: argparse.Namespace, folder: Path, run: Any) -> int:
    """``run()``, then the generated files removed (unless ``--keep``), the load before and after and
    the machine printed."""
    load_before = os.getloadavg()
    try:
        run()
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\nload average before {tuple(round(v, 1) for v in load_before)}, after "
        f"{tuple(round(v, 1) for v in os.getloadavg())}"
    )
    print(describe_machine())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="100000,1000000,10000000", help="Comma-separated row counts.")
    parser.add_argument("--formats", default="csv,parquet")
    parser.add_argument("--legacy", action="store_true", help="Also time veil.data.tabular's CSV reader.")
    parser.add_argument("--dir", default="/tmp/veil-bench-tables")
    parser.add_argument("--keep", action="store_true", help="Keep the generated files.")
    parser.add_argument(
        "--train", type=int, default=None, help="Time veil train on a table of this many rows."
    )
    parser.add_argument("--epsilon", type=float, default=3.0, help="Target ε of --train.")
    parser.add_argument(
        "--epochs", type=int, default=None, help="Epochs of --train (default: the preset's 50)."
    )
    parser.add_argument(
        "--stream", type=int, default=None, help="Time veil train --stream on a Parquet file of N rows."
    )
    parser.add_argument("--memory-rows", type=int, default=1_000_000, help="In-memory run beside --stream.")
    parser.add_argument("--batch", type=int, default=100_000, help="Expected batch of the --stream run.")
    parser.add_argument("--stream-rows", type=int, default=1_000_000, help="--stream-rows of that run.")
    parser.add_argument("--row-group", type=int, default=131_072, help="Parquet row group of --stream.")
    parser.add_argument("--physical-batch-size", type=int, default=None, help="For --stream's runs.")
    parser.add_argument(
        "--stream-read", default=None, help="Comma-separated row counts: the streaming read path alone."
    )
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    schema = folder / "schema.toml"
    schema.write_text(schema_text())
    if args.stream_read:
        sizes = [int(float(r)) for r in args.stream_read.split(",")]
        return _timed_run(
            args, folder, lambda: stream_read(folder, sizes, args.batch, args.stream_rows, args.row_group, 30)
        )
    if args.stream:
        return _timed_run(
            args,
            folder,
            lambda: stream_speed(
                folder,
                args.stream,
                args.memory_rows,
                args.batch,
                args.epochs or 1,
                args.stream_rows,
                args.row_group,
                args.physical_batch_size,
            ),
        )
    if args.train:
        return _timed_run(args, folder, lambda: train_speed(folder, args.train, args.epsilon, args.epochs))
    rows_out = []
    load_before = os.getloadavg()
    try:
        for rows in (int(float(r)) for r in args.rows.split(",")):
            t = time.perf_counter()
            csv_path, pq_path = generate(folder, rows)
            print(f"generated {rows} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
            kinds = args.formats.split(",") + (["legacy"] if args.legacy else [])
            for kind in kinds:
                path = pq_path if kind == "parquet" else csv_path
                m = measure(kind, path, schema)
                result_mb = rows * FEATURES * 4 / 1e6
                used_mb = (m["peak"] - m["base"]) / 1e6
                rows_out.append(
                    [
                        rows,
                        "csv (old Python reader)" if kind == "legacy" else kind,
                        round(path.stat().st_size / 1e6, 1),
                        round(m["seconds"], 2),
                        round(used_mb),
                        round(m["peak"] / 1e6),
                        f"{used_mb / result_mb:.2f}×",
                        round(rows / m["seconds"]),
                    ]
                )
                print(rows_out[-1], file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    header = ["rows", "format", "file MB", "load s", "peak − base MB", "peak RSS MB", "vs float32"]
    header.append("rows/s")
    print(markdown_table(header, rows_out))
    print(
        f"\nload average before {tuple(round(v, 1) for v in load_before)}, after "
        f"{tuple(round(v, 1) for v in os.getloadavg())}"
    )
    print(describe_machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
