"""Why `veil tune` does not beat `veil train` on small tables: `veil train` itself at a few settings.

    python bench/tune_tables_diagnosis.py --datasets german,gbsg2 --epsilons 1,3 --seeds 0,1,2
    python bench/tune_tables_diagnosis.py --ceiling      # non-private scikit-learn models, same splits

Each cell is one `veil train --dataset D --schema S --epsilon E --seed S --no-baseline --json` with the
settings of its row on top of the table preset (`veil train`'s defaults: logreg, Adam lr 0.05, 50
epochs, batch ⌈N/2⌉, C = 1). Test accuracy on the job's own test split (the seed fixes it), so this
is a look at the test set for diagnosis only: it chooses nothing veil ships. One thread.

``--ceiling``: what the same encoded features allow without privacy: scikit-learn's logistic
regression (C = 0.01, 0.1, 1, 100), histogram gradient boosting, a random forest and an MLP, fitted
on the same training split (the schema's public encoding, ``veil.data.load_dataset`` with the seed),
scored on the same test rows, with the test split's majority-class rate.
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

from common import markdown_table
from tune_vs_preset import _data_args

SETTINGS: dict[str, list[str]] = {
    "preset": [],
    "lr 0.2": ["--lr", "0.2"],
    "lr 0.0125": ["--lr", "0.0125"],
    "10 epochs": ["--epochs", "10"],
    "20 epochs": ["--epochs", "20"],
    "C 0.1": ["--max-grad-norm", "0.1"],
    "mlp": ["--model", "mlp"],
    "sgd lr 1": ["--optimizer", "sgd"],
    "full batch, 25 ep": ["--batch-size", "100000", "--epochs", "25"],
}


def ceiling(names: list[str], seeds: list[int]) -> str:
    """Non-private accuracies of a few scikit-learn models on the veil-encoded table (one row per seed)."""
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    from veil.data import load_dataset

    rows = []
    for name in names:
        args = _data_args(name)
        path, schema = args[1].removeprefix("csv:"), args[3]
        for seed in seeds:
            d = load_dataset(f"csv:{path}", schema=schema, seed=seed)
            xt, yt = d.x_train.reshape(d.n_train, -1), d.y_train
            xs, ys = d.x_test.reshape(len(d.y_test), -1), d.y_test
            models = [LogisticRegression(C=c, max_iter=2000) for c in (0.01, 0.1, 1.0, 100.0)]
            models += [HistGradientBoostingClassifier(max_iter=100, random_state=0),
                       RandomForestClassifier(300, min_samples_leaf=5, random_state=0, n_jobs=1),
                       MLPClassifier((64,), alpha=1e-2, max_iter=2000, random_state=0)]  # fmt: skip
            accs = [round(float(m.fit(xt, yt).score(xs, ys)), 3) for m in models]
            majority = round(float(max(np.mean(ys == c) for c in np.unique(yt))), 3)
            rows.append([name, seed, d.n_train, len(ys), majority, *accs])
    header = ["data", "seed", "n train", "n test", "majority", "LR C .01", "LR C .1", "LR C 1", "LR C 100",
              "HGB", "RF", "MLP"]  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", default="german,gbsg2")
    parser.add_argument("--epsilons", default="1,3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--ceiling", action="store_true", help="non-private scikit-learn models only")
    args = parser.parse_args(argv)
    if args.ceiling:
        print(ceiling(args.datasets.split(","), [int(s) for s in args.seeds.split(",")]))
        return 0
    import torch

    from veil.cli.main import main as veil

    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets.split(","):
            for eps in args.epsilons.split(","):
                for label in args.settings.split(","):
                    accs = []
                    t = time.perf_counter()
                    for seed in args.seeds.split(","):
                        out = Path(tmp) / f"{name}-{eps}-{label}-{seed}".replace(" ", "_")
                        buf = io.StringIO()
                        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                            code = veil(["train", *[a for a in _data_args(name) if a != "--tune-anyway"],
                                         "--epsilon", eps, "--seed", seed, "--no-baseline", "--json",
                                         "--db", str(Path(tmp) / "b.db"), "--out", str(out),
                                         *SETTINGS[label]])  # fmt: skip
                        assert code == 0, buf.getvalue()[-1500:]
                        r = json.loads(buf.getvalue().strip().splitlines()[-1])
                        accs.append(r["non_private"]["test_accuracy"])
                    row = [name, eps, label, *[round(a, 3) for a in accs], round(sum(accs) / len(accs), 4),
                           round(r["noise_multiplier"], 2), round(time.perf_counter() - t, 1)]  # fmt: skip
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    seeds = [f"seed {s}" for s in args.seeds.split(",")]
    print(markdown_table(["data", "ε", "settings", *seeds, "mean", "σ", "wall s"], rows))
    print(f"\nload average before {load}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
