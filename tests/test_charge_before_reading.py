"""`veil train` and `veil tune` reserve budget before the first private row is read (finding F1).

A refusal that happens after the rows are read (here: δ ≥ 1/N, known only once N is) depends on the
data, so it must not be free: the run stays charged with its stand-in plan (the target ε at δ). An
ordinary run still settles to exactly its ledger's events, and an over-budget run is still refused
before a row is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("pyarrow")

from tables_support import gbsg2
from test_tables_sources import GBSG2_SCHEMA
from veil.accounting.ledger import Ledger
from veil.cli.main import main
from veil.pipeline.private_data import stand_in_plan
from veil.registry.compose import spent_epsilon

DATASET_ID = "gbsg2-f1"
TOO_LARGE_DELTA = "0.01"
"""≥ 1/N for the table's training split (~550 rows): refused by the δ check, which needs N, after reading."""


def _table(tmp_path: Path) -> list[str]:
    (tmp_path / "schema.toml").write_text(GBSG2_SCHEMA)
    return [
        "--dataset",
        f"csv:{gbsg2()}",
        "--schema",
        str(tmp_path / "schema.toml"),
        "--dataset-id",
        DATASET_ID,
    ]


def _show(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["budget", "show", "--dataset-id", DATASET_ID, "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    return status


def test_a_train_refused_after_reading_stays_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*_table(tmp_path), "--epochs", "1", "--no-baseline", "--epsilon", "1", "--delta", TOO_LARGE_DELTA]
    code = main(["train", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "δ ≥ 1/N" in err
    status = _show(capsys)
    assert [r["status"] for r in status["runs"]] == ["committed"]  # charged, never released
    # The stand-in: a release of the target ε = 1 at the run's δ (σ calibrated to 0.5%).
    assert status["runs"][0]["events"] == [e.to_dict() for e in stand_in_plan(1.0, float(TOO_LARGE_DELTA))]
    assert status["spent_epsilon"] == pytest.approx(1.0, rel=0.01)


def test_a_tune_refused_after_reading_stays_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*_table(tmp_path), "--epochs", "1", "--model", "logreg", "--lr", "1.0,2.0"]
    code = main(["tune", *args, "--epsilon", "1", "--delta", TOO_LARGE_DELTA, "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == 2 and "δ ≥ 1/N" in err
    status = _show(capsys)
    assert [r["status"] for r in status["runs"]] == ["committed"]
    assert status["spent_epsilon"] == pytest.approx(1.0, rel=0.01)  # the stand-in, in RDP


def test_an_ordinary_train_settles_to_its_ledger_and_an_over_budget_one_reads_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = _table(tmp_path)
    assert main(["budget", "set", "--dataset-id", DATASET_ID, "--epsilon", "1.2", "--delta", "1e-5"]) == 0
    code = main(
        ["train", *table, "--epochs", "1", "--no-baseline", "--epsilon", "1", "--out", str(tmp_path / "a")]
    )
    assert code == 0, capsys.readouterr().err
    status = _show(capsys)
    ledger = Ledger.open(tmp_path / "a" / "ledger.jsonl").events()
    assert [r["status"] for r in status["runs"]] == ["committed"]
    assert status["spent_epsilon"] == pytest.approx(spent_epsilon([ledger], 1e-5), rel=1e-9)

    def no_reading(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the data was read")

    import veil.training.run

    monkeypatch.setattr(veil.training.run, "prepare_run", no_reading)
    code = main(["train", *table, "--epochs", "1", "--epsilon", "1", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "over its budget" in err and "data was read" not in err
    assert len(_show(capsys)["runs"]) == 1 and not (tmp_path / "b").exists()


@pytest.mark.parametrize(("epsilon", "delta"), [(1.0, 1e-5), (3.0, 1e-6)])
def test_the_stand_in_is_a_gaussian_of_exactly_the_target(epsilon: float, delta: float) -> None:
    """Against the closed form of the Gaussian mechanism's δ(ε) (Balle & Wang 2018, Thm 8), not the
    accountant: σ is (ε, δ)-DP, and 1% less noise would not be (σ is calibrated to 0.5%)."""
    import math

    def delta_at(eps: float, sigma: float) -> float:
        phi = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
        return phi(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * phi(-eps * sigma - 1 / (2 * sigma))

    from veil.accounting.events import Gaussian

    (event,) = stand_in_plan(epsilon, delta)
    assert isinstance(event, Gaussian)
    sigma = event.noise_multiplier
    assert delta_at(epsilon, sigma) <= delta * 1.001
    assert delta_at(epsilon, sigma * 0.99) > delta


@pytest.mark.parametrize("augment", ["2", "4"])
def test_augment_on_a_table_is_refused_before_anything_is_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], augment: str
) -> None:
    """The schema says the data is a table before a row is read: no stand-in is reserved for a run that
    --augment would refuse (it was refused after reading, and stayed charged; found by the review)."""
    assert main(["budget", "set", "--dataset-id", DATASET_ID, "--epsilon", "5", "--delta", "1e-5"]) == 0
    args = [*_table(tmp_path), "--epochs", "1", "--no-baseline", "--epsilon", "1", "--augment", augment]
    code = main(["train", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "augment" in err and "Traceback" not in err
    assert _show(capsys)["runs"] == []  # nothing reserved, nothing charged
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("dataset", "model"), [("digits", "auto"), ("fashion-mnist", "scatternet"), ("breast-cancer", "mlp")]
)
def test_augment_a_builtin_cannot_take_is_refused_before_anything_is_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dataset: str, model: str
) -> None:
    """A built-in dataset's kind and shape are documented, and so is the model it gets: --augment on a
    fixed-front model (digits' auto model is random features) or on a table is refused before the
    stand-in is reserved (it was refused after reading, and stayed charged)."""
    assert main(["budget", "set", "--dataset-id", DATASET_ID, "--epsilon", "5", "--delta", "1e-5"]) == 0
    args = ["--dataset", dataset, "--dataset-id", DATASET_ID, "--model", model, "--augment", "2"]
    code = main(["train", *args, "--epochs", "1", "--no-baseline", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "augment" in err and "Traceback" not in err
    assert _show(capsys)["runs"] == []
    assert not (tmp_path / "run").exists()


def test_a_train_without_a_label_set_is_refused_before_anything_is_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user file without --classes is refused by the loader's row-free check
    (:func:`veil.data.check_request`), run before the stand-in is reserved: nothing is charged."""
    data = tmp_path / "d.csv"
    data.write_text("a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(40)))
    code = main(["train", "--dataset", f"csv:{data}", "--target", "y", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "classes=None" in err and len(err.strip().splitlines()) == 1
    assert main(["budget", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mistake", ["no label set", "schema typo"])
def test_a_tune_refused_on_public_input_charges_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mistake: str
) -> None:
    """``veil tune`` runs the same row-free checks as ``veil train``
    (:func:`veil.pipeline.data.check_declarations`) before it reserves anything."""
    data = tmp_path / "d.csv"
    data.write_text("a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(40)))
    args = ["tune", "--dataset", f"csv:{data}", "--epsilon", "1", "--out", str(tmp_path / "run")]
    if mistake == "schema typo":
        schema = tmp_path / "s.toml"
        schema.write_text(
            '[columns.a]\ntype = "numeric"\nrole = "feature"\nbounds = [0, 40]\n'
            '[columns.y]\ntype = "categorical"\nrole = "target"\nclases = ["0", "1"]\n'
        )
        args += ["--schema", str(schema)]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert ("classes=None" if mistake == "no label set" else "unknown key") in err
    assert main(["budget", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []
    assert not (tmp_path / "run").exists()


_TYPO_SCHEMA = """reviewed = true
[columns."aa"]
type = "numeric"
bounds = [-4, 4]
[columns."b"]
type = "numeric"
bounds = [-4, 4]
[columns."y"]
role = "target"
classes = ["0", "1"]
"""

_HEADER_MISTAKES = {
    "train: --target not in the header": ["train", "--target", "yy", "--classes", "0,1", "--epochs", "1"],
    "train: a schema column not in the header": ["train", "--schema", "S", "--target", "y", "--epochs", "1"],
    "synth: a schema column not in the header": ["synth", "--schema", "S", "--epsilon", "1", "--rows", "10"],
    "federated: a schema column not in the header": [
        *("federated", "--mode", "record-level", "--schema", "S", "--target", "y", "--clients", "3"),
        *("--rounds", "2", "--epsilon", "4", "--delta", "1e-3"),
    ],
    "tune: a schema that does not exist": ["tune", "--schema", "MISSING", "--epsilon", "1"],
    "train: --stream on a CSV": ["train", "--target", "y", "--classes", "0,1", "--stream"],
    "train: text without a pretrained model": [
        *("train", "--target", "y", "--classes", "0,1", "--text-column", "a"),
    ],
    # revH's H9: a text run's missing label set or target, from the flags (M: a real model folder)
    "train: text without --classes": ["train", "--target", "y", "--text-column", "a", "--model", "M"],
    "train: text without --target": ["train", "--classes", "0,1", "--text-column", "a", "--model", "M"],
    "pate: --target not in the header": [
        *("pate", "--target", "yy", "--classes", "0,1", "--epsilon", "20", "--sigma", "1"),
        *("--queries", "5", "--teachers", "5", "--public-data", "P"),
    ],
}


@pytest.mark.parametrize("case", list(_HEADER_MISTAKES))
def test_a_mistake_seen_in_the_header_is_refused_before_anything_is_charged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """Column names are read from the header (no row) by :func:`veil.data.check_names` before any job
    charges the registry (revB: each of these was refused after the full charge)."""
    import numpy as np

    rng = np.random.default_rng(0)
    data = tmp_path / "d.csv"
    data.write_text(
        "a,b,y\n" + "".join(f"{u:.3f},{v:.3f},{int(u > 0)}\n" for u, v in rng.normal(size=(60, 2)))
    )
    (tmp_path / "s.toml").write_text(_TYPO_SCHEMA)
    np.savez(tmp_path / "pub.npz", x=rng.normal(size=(20, 2)))
    where = {"S": tmp_path / "s.toml", "MISSING": tmp_path / "nosuch.toml", "P": tmp_path / "pub.npz"}
    if "M" in _HEADER_MISTAKES[case]:
        from test_hf_minilm_probe import _minilm

        where["M"] = f"hf:{_minilm()}"
    args = [str(where[a]) if a in where else a for a in _HEADER_MISTAKES[case]]
    code = main([*args, "--dataset", f"csv:{data}", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert main(["budget", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []
    assert not (tmp_path / "run").exists()


def test_a_header_that_leaves_a_quote_open_is_refused_without_showing_a_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header is the first physical line alone: a quote left open there must not carry the parse
    into the private rows, whose values would then be "column names" shown in messages (revC)."""
    data = tmp_path / "d.csv"
    data.write_text('a,b,"y\n0.5,1.25,SECRET42\n0.1,0.2,1\n')
    args = ["train", "--dataset", f"csv:{data}", "--target", "y", "--classes", "0,1"]
    code = main([*args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "quote open" in err and "SECRET42" not in err and len(err.strip().splitlines()) == 1
    assert main(["budget", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []


@pytest.mark.parametrize("typo", ["--privacy-unit", "--target"])
def test_schema_infer_with_epsilon_refuses_a_column_typo_before_charging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], typo: str
) -> None:
    """``veil schema infer --epsilon`` checks its target, ignored and unit columns against the header
    before the registry is opened: a typo charges nothing and records no privacy unit (revC F2)."""
    data = tmp_path / "d.csv"
    data.write_text("a,b,y\n" + "".join(f"{i / 10},{i % 3},{i % 2}\n" for i in range(30)))
    target = "nosuch" if typo == "--target" else "y"
    unit = ["--privacy-unit", "nosuch"] if typo == "--privacy-unit" else []
    out = str(tmp_path / "s.toml")
    args = ["schema", "infer", f"csv:{data}", "--epsilon", "1", "--target", target, "--out", out, *unit]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and "no such column" in err and len(err.strip().splitlines()) == 1
    assert main(["budget", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["datasets"] == []
