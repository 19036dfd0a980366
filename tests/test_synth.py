"""`veil synth`: domain from the schema, model estimation and sampling, the command, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from veil.cli.main import main
from veil.mechanisms.rng import SeededSource
from veil.synth.domain import domain_from_schema
from veil.synth.junction import junction_tree
from veil.synth.pgm import Measurement, estimate, marginal_counts
from veil.tables.schema import parse_schema

SCHEMA = """
reviewed = true

[columns.age]
type = "numeric"
bounds = [0, 100]

[columns.grade]
type = "ordinal"
levels = ["I", "II", "III"]

[columns.city]
type = "categorical"
levels = ["a", "b", "c"]

[columns.smoker]
type = "boolean"

[columns.note]
type = "ignored"

[columns.label]
role = "target"
classes = ["no", "yes"]
"""


def _table(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lines = ["age,grade,city,smoker,note,label"]
    for _ in range(n):
        g = int(rng.integers(0, 3))
        age = float(np.clip(30 + 15 * g + rng.normal(0, 8), 0, 100))
        city = "abc"[int(rng.integers(0, 3))]
        smoker = bool(rng.random() < 0.2 + 0.2 * g)
        label = "yes" if (g == 2 or smoker) and rng.random() < 0.8 else "no"
        lines.append(f"{age:.1f},{['I', 'II', 'III'][g]},{city},{str(smoker).lower()},x,{label}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("synth")
    (folder / "schema.toml").write_text(SCHEMA)
    (folder / "data.csv").write_text(_table(2000))
    return {"folder": folder, "schema": folder / "schema.toml", "data": folder / "data.csv"}


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_domain_comes_from_the_schema_alone() -> None:
    domain = domain_from_schema(parse_schema(__import__("tomllib").loads(SCHEMA)), bins=8)
    assert domain.names == ["age", "grade", "city", "smoker", "label"]
    # numeric: 8 bins + missing; ordinal/categorical/boolean: levels + unknown + missing; target: classes.
    assert domain.sizes == (9, 5, 5, 4, 2)


def test_junction_tree_has_the_running_intersection_property() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = 7
        cliques = [
            tuple(sorted(rng.choice(n, size=int(rng.integers(1, 4)), replace=False))) for _ in range(5)
        ]
        tree = junction_tree(n, cliques, [3] * n)
        assert all(tree.containing(c) is not None for c in cliques)
        assert len(tree.order) == len(tree.cliques) - 1
        for a in range(n):  # the cliques holding any attribute form a connected subtree
            holding = {i for i, c in enumerate(tree.cliques) if a in c}
            edges = [(p, c) for p, c in tree.order if p in holding and c in holding]
            assert len(edges) == len(holding) - 1


def test_estimation_recovers_exact_tree_marginals_and_sampling_follows_the_model() -> None:
    rng = np.random.default_rng(0)
    n, sizes = 4000, (3, 4, 5)
    a = rng.integers(0, 3, n)
    b = (a + rng.integers(0, 2, n)) % 4
    c = (b + rng.integers(0, 3, n)) % 5
    x = np.stack([a, b, c], 1)
    ms = [Measurement((i,), marginal_counts(x, sizes, (i,)), np.ones(sizes[i]), 1.0) for i in range(3)]
    for cl in [(0, 1), (1, 2)]:
        ms.append(Measurement(cl, marginal_counts(x, sizes, cl), np.ones([sizes[i] for i in cl]), 1.0))
    model = estimate(sizes, ms, n, iterations=400)
    for cl in [(0, 1), (1, 2)]:
        assert 0.5 * np.abs(model.marginal(cl) - marginal_counts(x, sizes, cl)).sum() / n < 0.02
    syn = model.sample(n, SeededSource(1))
    # Systematic rounding: each 1-way count within one row per cell of the model's expectation.
    for i in range(3):
        assert np.abs(marginal_counts(syn, sizes, (i,)) - model.marginal((i,))).max() <= sizes[i] + 1


@pytest.fixture(scope="module")
def mst_run(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("runs") / "mst"
    code = main(["synth", "--dataset", f"csv:{files['data']}", "--schema", str(files["schema"]),
                 "--epsilon", "3", "--delta", "1e-6", "--rows", "500", "--out", str(out),
                 "--iterations", "200", "--bins", "8"])  # fmt: skip
    assert code == 0
    return out, json.loads((out / "report.json").read_text())


def test_synth_writes_a_private_table_and_a_report(
    mst_run: tuple[Path, dict], files: dict[str, Path]
) -> None:
    from veil.accounting.ledger import Ledger
    from veil.accounting.rdp import RDPAccountant
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    out, r = mst_run
    assert {"synthetic.csv", "synthetic.parquet", "report.json", "report.html", "ledger.jsonl"} <= {
        p.name for p in out.iterdir()
    }
    assert r["epsilon"] <= 3 and r["release_ready"] and r["randomness"].startswith("secure")
    assert r["non_private"]["internal"] and r["non_private"]["mean_tv"]["1"] < 0.2
    # The ledger replays to the reported ε.
    acc = RDPAccountant()
    for e in Ledger.open(out / "ledger.jsonl").events():
        acc.compose(e)
    assert acc.epsilon(1e-6) == pytest.approx(r["epsilon"], rel=1e-12)
    # The synthetic table is read back by the same schema (every column present, values in the domain).
    encoded = load_table(f"csv:{out / 'synthetic.csv'}", load_schema(files["schema"]))
    assert encoded.x.shape[0] == 500  # type: ignore[attr-defined]
    html = (out / "report.html").read_text()
    assert "Non-private" in html and "do not release" in html and "<script" not in html
    from test_report import SKELETON, _sections

    assert _sections(html) == SKELETON  # the one page skeleton of every job


def test_aim_spends_exactly_its_budget(files: dict[str, Path], tmp_path: Path) -> None:
    from veil.synth import synthesize

    r = synthesize(f"csv:{files['data']}", str(files["schema"]), epsilon=2.0, delta=1e-6, rows=200,
                   mechanism="aim", out=tmp_path / "aim", bins=4, degree=2, iterations=100,
                   secure_rng=False, seed=5)  # fmt: skip
    kinds = [e["type"] for e in r["events"]]
    assert "exponential_mechanism" in kinds and kinds[:5] == ["gaussian"] * 5
    assert r["rho_spent"] <= r["rho"] and r["rho_spent"] == pytest.approx(r["rho"], rel=1e-6)
    assert r["epsilon"] <= 2.0 and not r["release_ready"] and "seeded" in r["randomness"]


def test_bad_inputs_are_one_line_exit_2_and_nothing_written(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["synth", "--dataset", f"csv:{files['data']}", "--delta", "1e-6", "--rows", "10"]
    # A column of the data that the schema does not declare.
    partial = tmp_path / "partial.toml"
    partial.write_text(SCHEMA.replace('[columns.note]\ntype = "ignored"\n', ""))
    out = tmp_path / "a"
    code, _, err = _run(capsys, *base, "--schema", str(partial), "--epsilon", "1", "--out", str(out))
    assert code == 2 and "note" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    # ε far too small to measure even the 1-way marginals.
    out = tmp_path / "b"
    code, _, err = _run(
        capsys, *base, "--schema", str(files["schema"]), "--epsilon", "1e-4", "--out", str(out)
    )
    assert code == 2 and "1-way" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    # A domain too large to model: refused with its size and a fix.
    out = tmp_path / "c"
    code, _, err = _run(capsys, *base, "--schema", str(files["schema"]), "--epsilon", "1", "--bins", "500",
                        "--max-cells", "1000", "--out", str(out))  # fmt: skip
    assert code == 2 and "cells" in err and "--bins" in err and not out.exists()
    assert len(err.strip().splitlines()) == 1
