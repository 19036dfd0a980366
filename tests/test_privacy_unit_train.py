"""`veil train --privacy-unit COLUMN` on a table with several rows per person (CSV, Parquet, SQLite)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
sqlalchemy = pytest.importorskip("sqlalchemy")

from test_tables_sources import load_into_sql  # noqa: E402
from veil.cli.main import main  # noqa: E402

SCHEMA = """reviewed = true

[columns.patient_id]
type = "ignored"

[columns.a]
type = "numeric"
bounds = [-4.0, 4.0]

[columns.b]
type = "numeric"
bounds = [-4.0, 4.0]

[columns.outcome]
role = "target"
classes = ["no", "yes"]
"""
FAST = ["--epochs", "2", "--epsilon", "3", "--delta", "1e-4", "--json", "--no-baseline"]


def visits(path: Path, people: int = 200, seed: int = 0) -> None:
    """1–8 visits per patient; the outcome depends on the visit's features and the patient's latent."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(people):
        z = rng.normal()
        for _ in range(int(rng.integers(1, 9))):
            a, b = rng.normal(), rng.normal()
            y = "yes" if rng.random() < 1 / (1 + np.exp(-(1.5 * a - b + z))) else "no"
            rows.append([f"PATIENT-{p:04d}", f"{a:.3f}", f"{b:.3f}", y])
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["patient_id", "a", "b", "outcome"])
        writer.writerows(rows)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pyarrow.csv as pcsv

    folder = tmp_path_factory.mktemp("units")
    visits(folder / "visits.csv")
    (folder / "schema.toml").write_text(SCHEMA)
    table = pcsv.read_csv(folder / "visits.csv")
    pq.write_table(table, folder / "visits.parquet")
    engine = sqlalchemy.create_engine(f"sqlite:///{folder / 'visits.db'}")
    load_into_sql(engine, "visits", table)
    engine.dispose()
    return {"folder": folder, "csv": folder / "visits.csv", "schema": folder / "schema.toml"}


def _train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_unit_level_run_reports_the_unit_and_never_prints_an_id(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    code, stdout, err = _train(
        capsys,
        "--dataset",
        f"csv:{files['csv']}",
        "--schema",
        str(files["schema"]),
        "--privacy-unit",
        "patient_id",
        "--batch-size",
        "40",
        *FAST,
        "--out",
        str(out),
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    unit = report["privacy_unit"]
    assert unit["column"] == "patient_id" and unit["max_rows_per_unit"] == 16  # min(⌊1024/40⌋, 16)
    assert unit["rows_used_per_step"] == 40 * 16
    assert report["neighbouring"] == "add_or_remove_one_unit"
    assert report["sampling_rate"] == pytest.approx(40 / unit["units"])
    assert 100 < unit["units"] < 200  # the training side of 200 patients
    assert "each person (unit column `patient_id`), whatever number of rows they have" in report["covers"]
    # The dataset's budget is stated on the unit the registry records, in both reports (revD F3).
    released = json.loads((out / "release" / "report.json").read_text())
    for budget in (report["dataset_budget"], released["dataset_budget"]):
        assert budget["privacy_unit"] == "patient_id" and budget["unit"] == "privacy unit (patient_id)"
        assert budget["neighbouring"] == "add_or_remove_one_unit"
    html = (out / "report.html").read_text()
    assert "each person (unit column `patient_id`), whatever number of rows they have" in html
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".html", ".toml", ".jsonl", ""):
            assert "PATIENT-" not in path.read_text(errors="ignore"), path
    assert "PATIENT-" not in stdout + err
    # The first unit-level run on a dataset without runs records its unit in the registry ...
    code, shown, _ = _cli(capsys, "budget", "show", "--dataset", f"csv:{files['csv']}", "--json")
    assert code == 0 and json.loads(shown)["datasets"][0]["privacy_unit"] == "patient_id"
    # ... and a row-level run on it is refused before a row is read, nothing written or charged.
    code, _, err = _train(
        capsys,
        "--dataset",
        f"csv:{files['csv']}",
        "--schema",
        str(files["schema"]),
        *FAST,
        "--out",
        str(tmp_path / "rows"),
    )
    assert code == 2 and "refused before reading a row" in err and err.count("\n") == 1
    assert not (tmp_path / "rows").exists()
    code, shown, _ = _cli(capsys, "budget", "show", "--dataset", f"csv:{files['csv']}", "--json")
    assert len(json.loads(shown)["datasets"][0]["runs"]) == 1


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_budget_set_records_the_unit_and_every_run_must_protect_it(
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import veil.tables.encoder as encoder

    spec = f"csv:{files['csv']}"
    code, out, err = _cli(
        capsys,
        "budget",
        "set",
        "--dataset",
        spec,
        "--epsilon",
        "5",
        "--delta",
        "1e-5",
        "--privacy-unit",
        "patient_id",
    )
    assert code == 0, err
    code, out, _ = _cli(capsys, "budget", "show", "--dataset", spec)
    assert "each person (unit column `patient_id`)" in out
    monkeypatch.setattr(encoder.TableEncoder, "encode_batches", None)  # reading a row would fail loudly
    # visit_id is no column of the file: refused from the header (veil.data.check_names) before the
    # registry is asked; the registry's own refusal of another unit is the row-level case's rule
    for extra, needle in (([], "row-level run"), (["--privacy-unit", "visit_id"], "not a column")):
        code, _, err = _train(
            capsys,
            "--dataset",
            spec,
            "--schema",
            str(files["schema"]),
            *FAST,
            *extra,
            "--out",
            str(tmp_path / "run"),
        )
        assert code == 2 and needle in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()
    code, _, err = _cli(
        capsys,
        "budget",
        "set",
        "--dataset",
        spec,
        "--epsilon",
        "5",
        "--delta",
        "1e-5",
        "--privacy-unit",
        "other_id",
    )
    assert code == 2 and "`patient_id`" in err


def test_parquet_and_sql_read_the_same_units_as_csv(files: dict[str, Path]) -> None:
    from veil.data import load_dataset

    folder, schema = files["folder"], str(files["schema"])
    loaded = [
        load_dataset(spec, schema=schema, table=table, privacy_unit="patient_id", seed=3)
        for spec, table in (
            (f"csv:{files['csv']}", None),
            (f"parquet:{folder / 'visits.parquet'}", None),
            (f"sql:sqlite:///{folder / 'visits.db'}", "visits"),
        )
    ]
    first = loaded[0]
    assert first.units_train is not None and first.feature_names is not None
    assert not any("patient_id" in name for name in first.feature_names)  # the id is never a feature
    for data in loaded[1:]:
        assert data.units_train is not None
        np.testing.assert_array_equal(np.sort(data.units_train), np.sort(first.units_train))
        assert data.n_units == first.n_units and data.n_train == first.n_train


def test_k_is_applied_and_a_row_level_run_says_people_get_weaker_protection(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ["--dataset", f"csv:{files['csv']}", "--schema", str(files["schema"]), *FAST]
    code, _, err = _train(
        capsys,
        *base,
        "--privacy-unit",
        "patient_id",
        "--max-rows-per-unit",
        "2",
        "--out",
        str(tmp_path / "u"),
    )
    assert code == 0, err
    assert json.loads((tmp_path / "u" / "report.json").read_text())["privacy_unit"]["max_rows_per_unit"] == 2
    # The same file under a name, row-level: its unit-level run would join the name: refused.
    code, _, err = _train(capsys, *base, "--dataset-id", "visits-rows", "--out", str(tmp_path / "r"))
    assert code == 2 and "patient_id" in err and not (tmp_path / "r").exists()
    lines = files["csv"].read_text().splitlines()
    other = tmp_path / "visits-reordered.csv"  # the same records, other bytes: another file
    other.write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    base[1] = f"csv:{other}"
    code, _, err = _train(capsys, *base, "--dataset-id", "visits-rows", "--out", str(tmp_path / "r"))
    assert code == 0, err
    code, _, err = _cli(  # runs there protect rows: a unit cannot be recorded afterwards
        capsys,
        "budget",
        "set",
        "--dataset-id",
        "visits-rows",
        "--epsilon",
        "5",
        "--delta",
        "1e-5",
        "--privacy-unit",
        "patient_id",
    )
    assert code == 2 and "protect single rows" in err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["privacy_unit"] is None and "group privacy" in report["covers"]
    assert "a person with several rows gets weaker protection" in (tmp_path / "r" / "report.html").read_text()


def test_every_row_of_a_person_lands_on_one_side_of_the_split() -> None:
    from veil.data import split_by_unit, unit_hashes

    rng = np.random.default_rng(1)
    ids: list[object] = [f"P{int(u)}" for u in rng.integers(0, 300, size=3000)]
    ids[5] = None  # a row with no unit id: dropped by the per-record rule
    x = np.arange(len(ids), dtype=np.float32).reshape(-1, 1)
    y = np.zeros(len(ids), dtype=np.int64)
    x_tr, _, x_te, _, keys = split_by_unit(x, y, ids, 0.25, seed=7)
    side: dict[object, bool] = {}
    for rows, is_test in ((x_tr, False), (x_te, True)):
        for r in rows[:, 0].astype(int):
            assert side.setdefault(ids[r], is_test) == is_test  # one side per person
    assert None not in side and len(x_tr) + len(x_te) == len(ids) - 1
    assert len(np.unique(keys)) == len([v for v in side.values() if not v])
    assert set(unit_hashes(["P1"], 7)) == set(unit_hashes(["P1"], 7)) != set(unit_hashes(["P1"], 8))


@pytest.mark.parametrize(
    ("extra", "schema_edit", "needle"),
    [
        (["--privacy-unit", "person"], None, "not a column"),
        (["--privacy-unit", "a"], None, "identifier"),
        (["--privacy-unit", "patient_id", "--max-rows-per-unit", "0"], None, "max_rows_per_unit"),
        (["--max-rows-per-unit", "3"], None, "no unit column"),
        (["--privacy-unit", "patient_id", "--audit"], None, "--audit"),
        (["--privacy-unit", "person", "--stream"], "parquet", "not a column"),
        (["--privacy-unit", "patient_id"], "no-schema", "schema"),
    ],
)
def test_bad_unit_requests_are_refused_before_reading_one_line_exit_2_nothing_written(
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    extra: list[str],
    schema_edit: str | None,
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import veil.tables.encoder as encoder

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a row was read")

    monkeypatch.setattr(encoder.TableEncoder, "encode_batches", no_read)
    schema = [] if schema_edit == "no-schema" else ["--schema", str(files["schema"])]
    target = ["--target", "outcome", "--classes", "no,yes"] if schema_edit == "no-schema" else []
    data = (
        f"parquet:{files['folder'] / 'visits.parquet'}" if schema_edit == "parquet" else f"csv:{files['csv']}"
    )
    out = tmp_path / "run"
    code, _, err = _train(capsys, "--dataset", data, *schema, *target, *FAST, *extra, "--out", str(out))
    assert code == 2 and needle in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_job_that_cannot_protect_units_is_refused_on_a_unit_dataset(
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registry's door refuses it before reading: `schema infer --epsilon` protects rows."""
    from veil.tables.sources import csv_reader

    spec = f"csv:{files['csv']}"
    code, _, err = _cli(
        capsys, "budget", "set", "--dataset", spec, "--epsilon", "5", "--delta", "1e-5",
        "--privacy-unit", "patient_id",
    )  # fmt: skip
    assert code == 0, err

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a row was read")

    monkeypatch.setattr(csv_reader, "read_batches", no_read)
    monkeypatch.setattr(csv_reader, "read_table", no_read)
    out = tmp_path / "schema.toml"
    code, _, err = _cli(
        capsys, "schema", "infer", spec, "--target", "outcome", "--out", str(out), "--epsilon", "1"
    )
    assert code == 2 and "`patient_id`" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_the_tuning_score_moves_by_at_most_one_per_unit() -> None:
    """A person with many validation rows moves the per-unit score by ≤ 1 (a row count: by their rows)."""
    from veil.pipeline.private_data import record_mask
    from veil.tune.units import correct_count

    rng = np.random.default_rng(0)
    units = rng.integers(0, 50, size=400).astype(np.uint64)
    correct = rng.random(400) < 0.6
    with_person = correct_count(
        np.concatenate([correct, np.ones(30, bool)]), np.concatenate([units, np.full(30, 99, np.uint64)])
    )
    assert 0 < with_person - correct_count(correct, units) <= 1.0
    assert correct_count(correct, None) == correct.sum()  # row level: the plain count
    mask = record_mask(np.zeros((400, 1)), ["a"] * 400, 0.2, "veil.tune.validation", 0, units=units)
    assert not set(units[mask]) & set(units[~mask]) and mask.any()  # whole units held out


def test_tune_with_a_privacy_unit_trains_and_scores_units(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.accounting.tuning import TrialCount
    from veil.data import load_dataset
    from veil.tune.run import tune
    from veil.tune.space import SearchSpace

    monkeypatch.setattr(TrialCount, "sample", lambda self: 1)  # one trial: the test's own speed
    schema = str(files["schema"])
    report = tune(
        dataset=f"csv:{files['csv']}",
        epsilon=3.0,
        delta=1e-4,
        out=tmp_path / "tune",
        space=SearchSpace(lr=(0.5,), epochs=(1,), batch_size=(40,), max_grad_norm=(1.0,)),
        extra={"table_schema": schema, "privacy_unit": "patient_id"},
    )
    units = load_dataset(f"csv:{files['csv']}", schema=schema, privacy_unit="patient_id").n_units
    exact = report["non_private"]
    assert report["privacy_unit"] == "patient_id" and exact["n_train"] + exact["n_validation"] == units
    assert report["n_records"] == units
    # The statement names the person (review of issue 24: it said "add/remove-one neighbouring").
    statement = report["guarantee"]["statement"]
    assert "each person (unit column `patient_id`), whatever number of rows they have" in statement
    assert "add/remove-one neighbouring" not in statement
    public = json.loads((tmp_path / "tune" / "release" / "report.json").read_text())
    assert public["guarantee"]["statement"] == statement
    trial = json.loads((tmp_path / "tune" / "trials" / "1" / "report.json").read_text())
    assert trial["neighbouring"] == "add_or_remove_one_unit"
    assert trial["privacy_unit"]["units"] == exact["n_train"]


def test_synth_weights_move_each_marginal_by_at_most_one_per_person() -> None:
    """Each unit's rows weigh 1/n_u: a person with 40 rows moves any marginal by L1 ≤ 1 (unweighted: 40)."""
    from veil.synth.pgm import marginal_counts
    from veil.synth.units import unit_weights

    rng = np.random.default_rng(2)
    codes = rng.integers(0, 3, size=(300, 3))
    ids: list[object] = [f"P{int(u)}" for u in rng.integers(0, 60, size=300)]
    person = np.tile(rng.integers(0, 3, size=(1, 3)), (40, 1))
    ids_with = [*ids, *(["NEW"] * 40), None]  # and a row without an id: dropped
    codes_with = np.concatenate([codes, person, codes[:1]])
    kept, weights, units = unit_weights(ids)
    kept_with, weights_with, units_with = unit_weights(ids_with)
    assert kept.all() and not kept_with[-1] and units_with == units + 1
    for attrs in ((0,), (1, 2), (0, 1, 2)):
        before = marginal_counts(codes[kept], (3, 3, 3), attrs, weights)
        after = marginal_counts(codes_with[kept_with], (3, 3, 3), attrs, weights_with)
        assert np.abs(after - before).sum() <= 1 + 1e-12
    assert marginal_counts(codes, (3, 3, 3), (), weights) == pytest.approx(units)


def test_synth_with_a_privacy_unit_says_so(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "synth"
    code, stdout, err = _cli(
        capsys, "synth", "--dataset", f"csv:{files['csv']}", "--schema", str(files["schema"]),
        "--epsilon", "3", "--delta", "1e-4", "--rows", "100", "--privacy-unit", "patient_id",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(stdout)
    assert report["privacy_unit"] == "patient_id" and report["neighbouring"] == "add_or_remove_one_unit"
    assert (
        "each person (unit column `patient_id`), whatever number of rows they have"
        in report["guarantee"]["statement"]
    )
    assert report["guarantee"]["unit"] == "privacy unit"
    assert 150 < report["rows_estimated"] < 250  # the model's total is the number of people (200)
    assert "PATIENT-" not in (out / "synthetic.csv").read_text()


def test_a_dp_schema_release_reads_one_drawn_row_per_person() -> None:
    """One row per unit, uniform among its rows (seeded chi-square, false-failure rate 1e-3)."""
    from scipy import stats

    from veil.mechanisms.rng import make_source
    from veil.tables.infer import one_row_per_unit

    ids: list[object] = ["A", "B", "A", None, "C", "A", "B", "A"]
    rng = make_source(False, 11)
    picks = np.zeros(len(ids), dtype=np.int64)
    for _ in range(1000):
        rows = one_row_per_unit(ids, rng)
        assert sorted(ids[r] for r in rows) == ["A", "B", "C"]  # type: ignore[type-var]
        picks[rows] += 1
    assert picks[3] == 0 and picks[4] == 1000
    assert stats.chisquare(picks[[0, 2, 5, 7]]).pvalue > 1e-3  # A's 4 rows alike
    assert stats.chisquare(picks[[1, 6]]).pvalue > 1e-3


def test_schema_infer_with_a_privacy_unit_ignores_the_column_and_records_the_unit(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec, out = f"csv:{files['csv']}", tmp_path / "released.toml"
    code, _, err = _cli(
        capsys, "schema", "infer", spec, "--target", "outcome", "--out", str(out), "--epsilon", "2",
        "--delta", "1e-6", "--privacy-unit", "patient_id",
    )  # fmt: skip
    assert code == 0, err
    text = out.read_text()
    assert (
        '[columns."patient_id"]\ntype = "ignored"' in text
        and 'neighbouring = "add_or_remove_one_unit"' in text
    )
    assert "PATIENT-" not in text
    code, shown, _ = _cli(capsys, "budget", "show", "--dataset", spec, "--json")
    assert json.loads(shown)["datasets"][0]["privacy_unit"] == "patient_id"


def test_a_row_the_rules_drop_takes_its_unit_along(tmp_path: Path) -> None:
    """A row whose label is not declared is dropped (a per-record rule); the unit ids stay aligned with
    the rows that remain, so no row is attributed to another person."""
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    path = tmp_path / "v.csv"
    rows = [
        ["P1", "1", "0", "yes"],
        ["P2", "2", "0", "maybe"],
        ["P3", "3", "0", "no"],
        ["P3", "4", "0", "yes"],
    ]
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([["patient_id", "a", "b", "outcome"], *rows])
    (tmp_path / "s.toml").write_text(SCHEMA)
    encoded = load_table(f"csv:{path}", load_schema(tmp_path / "s.toml"), unit_column="patient_id")
    assert encoded.units == ["P1", "P3", "P3"]  # P2's row ('maybe' not declared) left with its id
    np.testing.assert_allclose(encoded.x[:, 0] * 4, [1, 3, 4], atol=1e-5)  # a in [-4, 4] scaled
    assert encoded.rules["rows_dropped_label_not_declared"] == 1
