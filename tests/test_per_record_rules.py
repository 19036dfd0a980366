"""No data-dependent halt after the first private row is read (issue 23, item 7): the schema's public
per-record rules apply instead (a label outside the declared classes drops the row, a text cell in a
numeric column is missing), their counts are reported as non-private, and no message echoes a cell."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from veil.errors import DataError

pytest.importorskip("pyarrow")


SCHEMA = """
reviewed = true

[columns.x]
type = "numeric"
bounds = [-5, 5]

[columns.city]
type = "categorical"
levels = ["a", "b"]

[columns.label]
role = "target"
classes = ["no", "yes"]
"""


def _rows(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    return [f"{rng.normal():.3f},{'ab'[i % 2]},{'no' if i % 3 else 'yes'}" for i in range(n)]


def _write(tmp_path: Path, extra: list[str], schema: str = SCHEMA) -> tuple[str, Path]:
    path = tmp_path / "t.csv"
    path.write_text("x,city,label\n" + "\n".join(_rows() + extra) + "\n")
    (tmp_path / "schema.toml").write_text(schema)
    return f"csv:{path}", tmp_path / "schema.toml"


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_undeclared_label_drops_the_row_and_a_text_cell_is_missing(tmp_path: Path, fmt: str) -> None:
    from veil.tables import load_table
    from veil.tables.encoder import EncodedTable
    from veil.tables.schema import load_schema

    spec, schema_path = _write(tmp_path, ["1.0,a,maybe-SECRET", "oops-SECRET,b,yes", "2.0,a,"])
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        strings = {name: pa.string() for name in ("x", "city", "label")}
        table = pacsv.read_csv(spec[4:], convert_options=pacsv.ConvertOptions(column_types=strings))
        pq.write_table(table, tmp_path / "t.parquet")
        spec = f"parquet:{tmp_path / 't.parquet'}"
    encoded = load_table(spec, load_schema(schema_path))
    assert isinstance(encoded, EncodedTable) and encoded.y is not None
    assert encoded.x.shape[0] == len(encoded.y) == 301  # 300 + the row whose x is not a number
    assert encoded.rules == {
        "rows_dropped_malformed": 0,
        "rows_dropped_label_not_declared": 1,
        "rows_dropped_label_missing": 1,
        "cells_not_a_number_made_missing": 1,
        "rows_dropped_outside": 0,
        "rows_dropped_unknown": 0,
        "rows_dropped_missing": 0,
    }
    missing = encoded.feature_names.index("x:missing")
    assert encoded.x[-1, missing] == 1.0 and encoded.x[:-1, missing].sum() == 0


def test_the_training_data_carries_the_rule_counts(tmp_path: Path) -> None:
    from veil.data import load_dataset

    spec, schema_path = _write(tmp_path, ["1.0,a,maybe", "oops,b,yes"])
    data = load_dataset(spec, schema=str(schema_path))
    assert data.n_train + data.n_test == 301
    assert data.rules["rows_dropped_label_not_declared"] == 1
    assert data.rules["cells_not_a_number_made_missing"] == 1


def test_a_ragged_row_is_skipped_and_counted_never_refused(tmp_path: Path) -> None:
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    # A ragged row (one field too many): a per-record rule skips it (it was a refusal naming its line,
    # after the run was charged: one record's shape stopped the run).
    spec, schema_path = _write(tmp_path, ["1.0,a,no,SECRET-1"])
    encoded = load_table(spec, load_schema(schema_path))
    assert encoded.rules["rows_dropped_malformed"] == 1


def test_synth_stays_charged_when_it_stops_after_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synth run that stops after the run is marked read (here a failure planted just after the rows
    are read) keeps its reservation: once reading has begun, whether a run stops may depend on the
    data, so releasing the charge would make the registry depend on it. (A column the schema does not
    declare is now refused from the header before the charge, and a δ ≥ 1/N no longer stops synth,
    whose N is private: tests/test_charge_before_reading.py, tests/test_synth_private_n.py.)"""
    pytest.importorskip("sqlalchemy")
    import veil.synth.run as synth_run
    from _budget_cli import cli, show

    def after_reading(*args: object, **kwargs: object) -> None:
        raise DataError("dataset", "the rows", "a failure after reading (planted)", "none")

    monkeypatch.setattr(synth_run, "codes_from_features", after_reading)
    spec, schema_path = _write(tmp_path, [])
    code, _, err = cli(capsys, "synth", "--dataset", spec, "--schema", str(schema_path), "--epsilon", "1",
                       "--delta", "1e-6", "--rows", "10", "--out", str(tmp_path / "s"))  # fmt: skip
    assert code == 2 and "planted" in err
    (run,) = show(capsys, spec)["runs"]
    assert run["job"] == "synth" and run["status"] == "committed" and run["epsilon"] > 0
    assert [e["type"] for e in run["events"]] == ["zcdp"]  # settled at its plan


def test_train_reports_the_rule_counts_as_non_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from veil.cli.main import main

    spec, schema_path = _write(tmp_path, ["1.0,a,maybe-SECRET", "oops-SECRET,b,yes"])
    out = tmp_path / "run"
    code = main(["train", "--dataset", spec, "--schema", str(schema_path), "--epochs", "1", "--epsilon", "2",
                 "--model", "logreg", "--no-baseline", "--out", str(out), "--json"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "SECRET" not in printed.out + printed.err
    report = json.loads((out / "report.json").read_text())
    assert report["non_private"]["per_record_rules"] == {
        "rows_dropped_malformed": 0,
        "rows_dropped_label_not_declared": 1,
        "rows_dropped_label_missing": 0,
        "cells_not_a_number_made_missing": 1,
        "rows_dropped_outside": 0,
        "rows_dropped_unknown": 0,
        "rows_dropped_missing": 0,
        "examples_dropped_gradient_not_finite": 0,
    }


STRICT = """
reviewed = true

[columns.x]
type = "numeric"
bounds = [-5, 5]
outside = "error"
missing = "error"

[columns.city]
type = "categorical"
levels = ["a", "b"]
unknown = "error"

[columns.who]
type = "ignored"

[columns.label]
role = "target"
classes = ["no", "yes"]
"""


def _write_strict(tmp_path: Path, extra: list[str], schema: str = STRICT) -> tuple[str, Path]:
    path = tmp_path / "strict.csv"
    rows = [f"{r.split(',')[0]},{r.split(',')[1]},u{i},{r.split(',')[2]}" for i, r in enumerate(_rows())]
    path.write_text("x,city,who,label\n" + "\n".join(rows + extra) + "\n")
    (tmp_path / "strict.toml").write_text(schema)
    return f"csv:{path}", tmp_path / "strict.toml"


BREAKING = ["9.0,a,SECRET-out,no", "NA,b,SECRET-miss,yes", "1.0,SECRET-city,SECRET-unk,no"]
"""One row breaking each "error" (drop) policy: outside the bounds, missing, a level not declared."""


@pytest.mark.parametrize("policy", ["error", "drop"])
def test_a_row_breaking_a_drop_policy_is_dropped_and_counted_never_refused(
    tmp_path: Path, policy: str
) -> None:
    """``outside``/``missing``/``unknown = "error"`` (old spelling) or ``"drop"``: the row is dropped by
    a public per-record rule, counted per rule; no refusal once rows are read."""
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    spec, schema_path = _write_strict(tmp_path, BREAKING, STRICT.replace('"error"', f'"{policy}"'))
    schema = load_schema(schema_path)
    encoded = load_table(spec, schema)
    assert encoded.x.shape[0] == len(encoded.y) == 300
    assert encoded.rules["rows_dropped_outside"] == 1
    assert encoded.rules["rows_dropped_missing"] == 1
    assert encoded.rules["rows_dropped_unknown"] == 1
    assert encoded.dropped is not None and encoded.dropped.tolist() == [False] * 300 + [True] * 3
    # The same rows without the breaking ones encode the same: a drop is a function of the row alone.
    (tmp_path / "clean").mkdir()
    clean, _ = _write_strict(tmp_path / "clean", [])
    np.testing.assert_array_equal(load_table(clean, schema).x, encoded.x)


def test_a_dropped_row_takes_its_unit_id_along(tmp_path: Path) -> None:
    """With a privacy-unit column the rows are encoded undropped, then one filtering step removes the
    rows any rule drops — label or feature — together with their unit ids."""
    from veil.tables import load_table
    from veil.tables.schema import load_schema

    extra = [*BREAKING, "1.0,a,SECRET-lab,maybe"]
    spec, schema_path = _write_strict(tmp_path, extra)
    encoded = load_table(spec, load_schema(schema_path), unit_column="who")
    assert encoded.x.shape[0] == len(encoded.y) == len(encoded.units) == 300
    assert encoded.units == [f"u{i}" for i in range(300)]
    assert encoded.rules["rows_dropped_label_not_declared"] == 1


def test_schema_check_counts_the_drops(tmp_path: Path) -> None:
    from veil.cli.schema import run_check

    spec, schema_path = _write_strict(tmp_path, BREAKING)
    result = run_check(str(schema_path), spec)
    assert result["rows (not private: for your eyes only)"] == 300
    assert result["rows dropped outside (not private)"] == 1
    assert "SECRET" not in json.dumps(result)
