"""Load time and peak memory of the table readers (CSV and Parquet), from file to encoded float32 matrix.

    python bench/tables.py                          # 10^5, 10^6, 10^7 rows × 20 numeric columns
    python bench/tables.py --rows 100000 --legacy   # also the old pure-Python CSV reader, for comparison
    python bench/tables.py --train 1000000          # DP training examples/s (veil train) on that table

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


def train_speed(folder: Path, rows: int, epsilon: float) -> None:
    """``veil train`` on the N-row CSV with its reviewed schema: DP examples/s and the baseline's cost.

    Three timings in this process: the load (read + encode), a run without the baseline and a run
    with it. DP-SGD examples/s = planned epochs × training rows / (run without baseline − load);
    the baseline's cost is the difference of the two runs. Defaults of the table preset (50 epochs,
    expected batch N/2, logistic regression).
    """
    import tempfile

    from veil import train
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    csv_path, _ = generate(folder, rows)
    schema = folder / "schema.toml"
    t = time.perf_counter()
    load_table(f"csv:{csv_path}", load_schema(schema))
    load_s = time.perf_counter() - t
    results = []
    for baseline in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            report = train(
                {
                    "dataset": f"csv:{csv_path}",
                    "table_schema": str(schema),
                    "epsilon": epsilon,
                    "delta": 1e-7,
                    "baseline": baseline,
                    "out": str(Path(tmp) / "run"),
                },
                progress=False,
            )
            results.append((time.perf_counter() - t, report))
    (dp_s, dp), (both_s, with_base) = results
    examples = dp.epochs * dp.dataset.n_train
    header = [
        "rows",
        "load s",
        "run s (no baseline)",
        "steps",
        "DP examples/s",
        "baseline s",
        "DP acc",
        "baseline acc",
    ]
    row = [
        rows,
        round(load_s, 1),
        round(dp_s, 1),
        dp.steps,
        round(examples / max(dp_s - load_s, 1e-9)),
        round(both_s - dp_s, 1),
        round(dp.test_accuracy, 4),
        round(with_base.baseline_test_accuracy or 0.0, 4),
    ]
    print(markdown_table(header, [row]))
    print(
        f"\nε = {dp.epsilon_spent:.3f} (target {epsilon:g}), δ = 1e-7, "
        f"batch {dp.batch_size}, epochs {dp.epochs}"
    )


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
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    schema = folder / "schema.toml"
    schema.write_text(schema_text())
    if args.train:
        load_before = os.getloadavg()
        try:
            train_speed(folder, args.train, args.epsilon)
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
        print(
            f"\nload average before {tuple(round(v, 1) for v in load_before)}, after "
            f"{tuple(round(v, 1) for v in os.getloadavg())}"
        )
        print(describe_machine())
        return 0
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
    header = ["rows", "format", "file MB", "load s", "peak − base MB", "peak RSS MB", "vs float32", "rows/s"]
    print(markdown_table(header, rows_out))
    print(
        f"\nload average before {tuple(round(v, 1) for v in load_before)}, after "
        f"{tuple(round(v, 1) for v in os.getloadavg())}"
    )
    print(describe_machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
