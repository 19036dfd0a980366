"""Federated record-level silos protecting people against protecting rows, on a longitudinal table.

    OMP_NUM_THREADS=1 python bench/federated_units.py --people 1000

The generated visits table of ``bench/privacy_unit.py`` (1–50 rows per person, a logistic model with
a per-person effect) is written as a CSV with a reviewed schema (the person column ``type =
"ignored"``) and trained by ``veil federated --mode record-level`` over 3 IID silos (Flower's
simulation engine, the real veil apps, one CPU) twice at each ε: once protecting rows (silos by
row hash, q = B / rows of the silo), once with ``--privacy-unit person`` (silos by the person's
hash, q = B / people of the silo, at most K rows of a person per step, the mean of their gradients
clipped once). Same model, B, rounds, local steps, C, lr and δ; research-mode seed (not a release).
Test accuracy (held-out people: the split is by person in both runs) is a non-private figure.
Prints a markdown table and one JSON line per run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table
from privacy_unit import visits_table

SCHEMA = """reviewed = true

[columns.person]
type = "ignored"

[columns.x0]
type = "numeric"
bounds = [-5.0, 5.0]

[columns.x1]
type = "numeric"
bounds = [-5.0, 5.0]

[columns.x2]
type = "numeric"
bounds = [-5.0, 5.0]

[columns.outcome]
role = "target"
classes = ["no", "yes"]
"""


def write_table(folder: Path, people: int) -> tuple[Path, Path, int]:
    x, y, ids = visits_table(people)
    path = folder / "visits.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["person", "x0", "x1", "x2", "outcome"])
        for i in range(len(y)):
            w.writerow([ids[i], *(f"{v:.4f}" for v in x[i]), "yes" if y[i] else "no"])
    (folder / "schema.toml").write_text(SCHEMA)
    return path, folder / "schema.toml", len(y)


def run(args: argparse.Namespace, table: Path, schema: Path, epsilon: float, unit: bool, out: Path) -> dict:
    from veil.federated.run import simulate
    from veil.federated.settings import FederatedSettings

    s = FederatedSettings(
        mode="record-level",
        dataset=f"csv:{table}",
        table_schema=str(schema),
        privacy_unit="person" if unit else "",
        clients=args.silos,
        rounds=args.rounds,
        local_steps=args.local_steps,
        local_batch=args.local_batch,
        local_lr=args.lr,
        clip=1.0,
        epsilon=epsilon,
        delta=args.delta,
        model="logreg",
        seed=args.seed,
        out=str(out),
    )
    os.environ["VEIL_BUDGET_DB"] = str(out.parent / f"{out.name}-budget.db")  # a registry per run
    start = time.monotonic()
    report = simulate(s, cpus=1)
    seconds = time.monotonic() - start
    g = report["guarantee"]
    silos = g["extra"]["silos"] if "extra" in g else g["silos"]
    return {
        "epsilon": epsilon,
        "protects": "people (--privacy-unit)" if unit else "rows",
        "epsilon_spent": g["epsilon"],
        "neighbouring": g["neighbouring"],
        "silo_sampling_rates": [round(v["sampling_rate"], 5) for v in silos.values()],
        "silo_sigmas": [round(v["noise_multiplier"], 3) for v in silos.values()],
        "silo_records": [v.get("units", v["rows"]) for v in silos.values()],
        "test_accuracy": report["non_private"]["test_accuracy"],
        "seconds": round(seconds, 1),
        "max_rows_per_unit": (report.get("privacy_unit") or {}).get("max_rows_per_unit"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--people", type=int, default=1000)
    p.add_argument("--silos", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--local-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epsilons", default="1,3")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        table, schema, rows = write_table(Path(tmp), args.people)
        for eps in (float(e) for e in args.epsilons.split(",")):
            for unit in (False, True):  # interleaved: the two runs of one ε back to back
                r = run(args, table, schema, eps, unit, Path(tmp) / f"run-{eps:g}-{int(unit)}")
                results.append(r)
                print(json.dumps(r), flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print(f"\n{args.people} people, {rows} rows; {args.silos} silos, {args.rounds} rounds × "
          f"{args.local_steps} steps, B = {args.local_batch}, δ = {args.delta:g}\n")  # fmt: skip
    head = ["ε", "protects", "ε spent", "q per silo", "σ", "K", "test accuracy", "seconds"]
    table_rows = [
        [r["epsilon"], r["protects"], f"{r['epsilon_spent']:.3f}",
         ", ".join(map(str, r["silo_sampling_rates"])),
         r["silo_sigmas"][0], r["max_rows_per_unit"] or "–", f"{r['test_accuracy']:.3f}", r["seconds"]]
        for r in results
    ]  # fmt: skip
    print(markdown_table(head, table_rows))


if __name__ == "__main__":
    main()
