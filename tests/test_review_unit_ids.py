"""Adversarial review of issue 24: a unit id is read as text whatever its stored type, never failing.

A Parquet unit column of bytes with one id that is not UTF-8 made every unit-level run crash after
reading (pyarrow's cast raised "Invalid UTF8 payload", a traceback; the stand-in stayed charged): a
failure on one person's value. Each cell is now text by a rule on the cell alone
(:func:`veil.tables.units.unit_texts`). Planted: restore the plain ``cast(pa.string())`` in
``collect_units`` and the in-memory run fails; in ``veil.tables.stream._unit_sides``, the streamed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from _budget_cli import cli as _cli  # noqa: E402
from test_privacy_unit_train import SCHEMA, visits  # noqa: E402


def test_unit_texts_is_a_rule_on_each_cell() -> None:
    from veil.tables.units import unit_texts

    assert unit_texts(pa.array([b"P1", b"\xff\xfe", None], pa.binary())) == ["5031", "fffe", None]
    # one-to-one: a byte id that spells another's escape is still another person
    assert len(set(unit_texts(pa.array([b"\xff", b"\\xff", b"ff"], pa.binary())))) == 3
    assert unit_texts(pa.chunked_array([pa.array(["P1", None, "P1"]).dictionary_encode()])) == [
        "P1",
        None,
        "P1",
    ]
    assert unit_texts(pa.array([7, None], pa.int64())) == ["7", None]
    # A float NaN id is missing (no one's), not one "nan" person merging many people's rows.
    assert unit_texts(pa.array([1.0, float("nan"), None], pa.float64())) == ["1", None, None]
    assert unit_texts(pa.array(["007", "7"])) == ["007", "7"]


def test_a_numeric_unit_id_reads_the_same_whatever_another_persons_id_is() -> None:
    """Review: Arrow's cast wrote 10**15 as "1e+15" once another person's id (7.5) made the column
    real, and "1000000000000000" beside integers — one person's key, hence side of the split, moved
    with another's record. Each id is now ``number_text`` of its own value."""
    from veil.tables.units import unit_texts

    alone = unit_texts(pa.array([10**15, 3], pa.int64()))
    beside_a_real = unit_texts(pa.array([1e15, 7.5, -0.0], pa.float64()))
    assert beside_a_real[0] == alone[0] == "1000000000000000"
    assert beside_a_real[2] == unit_texts(pa.array([0], pa.int64()))[0] == "0"


@pytest.mark.parametrize("stream", [False, True])
def test_a_unit_id_that_is_not_utf8_is_an_id_not_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stream: bool
) -> None:
    import pyarrow.csv as pcsv

    visits(tmp_path / "v.csv", people=120)
    table = pcsv.read_csv(tmp_path / "v.csv")
    ids = [v.encode() for v in table["patient_id"].to_pylist()]
    ids = [b"\xff\xfe" + v if v.endswith(b"7") else v for v in ids]  # some people's ids are not UTF-8
    table = table.set_column(0, "patient_id", pa.array(ids, pa.binary()))
    pq.write_table(table, tmp_path / "v.parquet", row_group_size=64)
    (tmp_path / "schema.toml").write_text(SCHEMA)
    out = tmp_path / "run"
    data, schema = f"parquet:{tmp_path / 'v.parquet'}", str(tmp_path / "schema.toml")
    args = ["train", "--dataset", data, "--schema", schema, "--privacy-unit", "patient_id",
            "--batch-size", "20", "--epochs", "1", "--epsilon", "2", "--delta", "1e-4", "--no-baseline",
            "--json", "--out", str(out), *(["--stream"] if stream else [])]  # fmt: skip
    code, _, err = _cli(capsys, *args)
    assert code == 0, err[-500:]
    report = json.loads((out / "report.json").read_text())
    assert 60 < report["privacy_unit"]["units"] < 120  # every person a unit, the bad ids included
