"""Adversarial review of issue 24: ``veil schema infer --epsilon --privacy-unit`` reads unit ids as text.

Type inference made ``007``, ``7`` and ``7.0`` one unit (and two 20-digit ids one float), where the
train/synth/federated readers (unit column read as text) see separate people: one drawn row per
merged "unit" would then protect them only as a replaced row. Planted: read the ids through the typed
reader again (``_Columns(...).cast("string")``) and this test fails (3 units instead of 7)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")


def test_schema_infer_reads_unit_ids_as_the_other_jobs_do(tmp_path: Path) -> None:
    from veil.tables import load_table
    from veil.tables.infer import unit_ids
    from veil.tables.schema import load_schema
    from veil.tables.sources import parse_source

    ids = ["007", "7", "7.0", "12345678901234567890", "12345678901234567891", "1e1", "10", "", "NA"]
    path = tmp_path / "t.csv"
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["pid", "a", "y"])
        writer.writerows([[pid, "1.0", "no"] for pid in ids])
    seen = unit_ids(parse_source(f"csv:{path}"), "pid")
    assert seen == [*ids[:7], None, None]  # every id as written; missing markers are no one's
    (tmp_path / "s.toml").write_text(
        'reviewed = true\n[columns.pid]\ntype = "ignored"\n[columns.a]\ntype = "numeric"\n'
        'bounds = [0.0, 2.0]\n[columns.y]\nrole = "target"\nclasses = ["no", "yes"]\n'
    )
    encoded = load_table(f"csv:{path}", load_schema(str(tmp_path / "s.toml")), unit_column="pid")
    assert list(encoded.units) == seen  # the train/synth reader's ids: the same people
