"""The table schema (TOML) and the data-independent encoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tables_support import actg175, gbsg2, german_credit  # noqa: E402
from veil.errors import ConfigError, DataError  # noqa: E402
from veil.tables import load_table  # noqa: E402
from veil.tables.encoder import TableEncoder  # noqa: E402
from veil.tables.schema import load_schema, parse_schema, schema_to_toml  # noqa: E402
from veil.tables.sources import TableSource, parse_source, read_source  # noqa: E402

SCHEMA = """
reviewed = true
missing_values = ["", "?", "NA"]

[columns.age]
type = "numeric"
bounds = [0, 100]

[columns.colour]
type = "categorical"
levels = ["red", "green"]

[columns.grade]
type = "ordinal"
levels = ["low", "mid", "high"]

[columns.smoker]
type = "boolean"

[columns.city]
type = "categorical"
levels = ["a", "b", "c"]
encoding = "embedding"

[columns.note]
type = "text"

[columns.id]
type = "ignored"

[columns.label]
role = "target"
classes = ["no", "yes"]
"""

CSV = (
    "\ufeffage,colour,grade,smoker,city,note,id,label\n"
    '50,red,low,yes,a,"hello, world",1,no\n'
    "150,blue,high,no,b,x,2,yes\n"
    "?,green,mid,,c,y,3,yes\n"
    "-20,NA,,TRUE,z,z,4,no\n"
)


def _loads(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    schema = tmp_path / "s.toml"
    schema.write_text(SCHEMA)
    data = tmp_path / "d.csv"
    data.write_text(CSV, encoding="utf-8")
    return schema, data


def test_schema_round_trips_through_toml() -> None:
    schema = parse_schema(_loads(SCHEMA))
    again = parse_schema(_loads(schema_to_toml(schema)))
    assert again == schema
    assert [c.name for c in schema.features] == ["age", "colour", "grade", "smoker", "city"]
    assert schema.target is not None and schema.target.levels == ("no", "yes")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace("bounds = [0, 100]", "bonds = [0, 100]"), "did you mean 'bounds'"),
        (lambda s: s.replace("bounds = [0, 100]", "bounds = [5, 5]"), "public, finite bounds"),
        (lambda s: s.replace('classes = ["no", "yes"]', ""), "output width"),
        (lambda s: s.replace('type = "boolean"', 'type = "bool"'), "'bool' is not a column type"),
        (lambda s: s.replace("reviewed = true", 'reviewed = "yes"'), "reviewed="),
        (lambda s: s.replace('levels = ["red", "green"]', 'levels = ["red", "red"]'), "listed twice"),
        (lambda s: s.replace("reviewed = true", 'reviewed = "dp"'), "must record its release"),
        (lambda s: "colour = 1\n" + s, "unknown top-level key"),
    ],
)
def test_bad_schemas_are_refused_by_name(edit, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_schema(_loads(edit(SCHEMA)))


def test_a_draft_is_refused_with_what_to_check() -> None:
    draft = parse_schema(_loads(SCHEMA.replace("reviewed = true", "reviewed = false")))
    with pytest.raises(ConfigError) as info:
        draft.require_reviewed()
    text = str(info.value)
    assert "reviewed = true" in text and "public knowledge" in text and "\n" not in text
    parse_schema(_loads(SCHEMA)).require_reviewed()


def test_encoding_follows_the_schema(files: tuple[Path, Path]) -> None:
    schema_path, data = files
    enc = load_table(f"csv:{data}", load_schema(schema_path))
    names = enc.feature_names
    assert names == [
        "age", "age:missing",
        "colour=red", "colour=green", "colour:unknown", "colour:missing",
        "grade", "grade:unknown", "grade:missing",
        "smoker", "smoker:unknown", "smoker:missing",
        "city",
    ]  # fmt: skip
    x = dict(zip(names, enc.x.T, strict=True))
    np.testing.assert_allclose(
        x["age"], [0.0, 1.0, 0.0, -1.0]
    )  # 50 → 0; 150 clipped; missing → 0; -20 clipped
    np.testing.assert_array_equal(x["age:missing"], [0, 0, 1, 0])
    np.testing.assert_array_equal(x["colour=red"], [1, 0, 0, 0])
    np.testing.assert_array_equal(x["colour:unknown"], [0, 1, 0, 0])  # "blue"
    np.testing.assert_array_equal(x["colour:missing"], [0, 0, 0, 1])  # "NA"
    np.testing.assert_allclose(x["grade"], [-1, 1, 0, 0])
    np.testing.assert_array_equal(x["grade:missing"], [0, 0, 0, 1])
    np.testing.assert_array_equal(x["smoker"], [1, -1, 0, 1])
    np.testing.assert_array_equal(x["smoker:missing"], [0, 0, 1, 0])
    np.testing.assert_array_equal(x["city"], [0, 1, 2, 3])  # "z" → unknown code L = 3
    np.testing.assert_array_equal(enc.y, [0, 1, 1, 0])
    assert enc.x.dtype == np.float32


def test_each_row_is_encoded_alone(files: tuple[Path, Path], tmp_path: Path) -> None:
    """Data independence: a row's encoding does not change with the other rows of the table."""
    schema_path, data = files
    schema = load_schema(schema_path)
    whole = load_table(f"csv:{data}", schema).x
    lines = CSV.splitlines()
    for i, line in enumerate(lines[1:]):
        single = tmp_path / f"row{i}.csv"
        single.write_text(lines[0] + "\n" + line + "\n", encoding="utf-8")
        np.testing.assert_array_equal(load_table(f"csv:{single}", schema).x[0], whole[i])


def test_encoder_saved_and_loaded_encodes_the_same(files: tuple[Path, Path], tmp_path: Path) -> None:
    schema_path, data = files
    encoder = TableEncoder(load_schema(schema_path))
    encoder.save(tmp_path / "encoder.json")
    again = TableEncoder.load(tmp_path / "encoder.json")
    raw = read_source(parse_source(f"csv:{data}"), again.schema)
    np.testing.assert_array_equal(again.encode(raw).x, encoder.encode(raw).x)
    assert again.embeddings == [(12, 5)]


@pytest.mark.parametrize(
    ("edit_schema", "edit_csv", "match"),
    [
        (None, lambda c: c.replace("smoker,", "smoking,"), "schema column 'smoker'.*missing from the data"),
        (
            None,
            lambda c: (
                c.replace(",label", ",label,extra").replace("no\n", "no,1\n").replace("yes\n", "yes,1\n")
            ),
            "data column 'extra'",
        ),
    ],
)
def test_values_outside_the_schema_are_refused_with_row_and_column(
    files, edit_schema, edit_csv, match
) -> None:
    schema_path, data = files
    if edit_schema:
        schema_path.write_text(edit_schema(SCHEMA))
    if edit_csv:
        data.write_text(edit_csv(CSV), encoding="utf-8")
    with pytest.raises(DataError, match=match) as info:
        load_table(f"csv:{data}", load_schema(schema_path))
    assert "\n" not in str(info.value)
    for cell in ("150", "blue", "'z'", "z,"):  # the refused cells: named by row and column, never shown
        assert f"={cell}" not in str(info.value) and f"'{cell}'" not in str(info.value)


@pytest.mark.parametrize(
    ("edit_schema", "rows", "rule", "count"),
    [
        (lambda s: s.replace("bounds = [0, 100]", 'bounds = [0, 100]\noutside = "error"'), 2, "outside", 2),
        (lambda s: s.replace("bounds = [0, 100]", 'bounds = [0, 100]\noutside = "drop"'), 2, "outside", 2),
        (lambda s: s.replace('"green"]', '"green"]\nunknown = "error"'), 3, "unknown", 1),
        (lambda s: s.replace('type = "boolean"', 'type = "boolean"\nmissing = "error"'), 3, "missing", 1),
        (lambda s: s.replace('"embedding"', '"embedding"\nunknown = "drop"'), 3, "unknown", 1),
    ],
)
def test_a_drop_policy_of_the_schema_drops_the_row_never_refuses(
    files, edit_schema, rows: int, rule: str, count: int
) -> None:
    """Issue 23, item 7: ``outside``/``unknown``/``missing = "drop"`` (old name ``"error"``) drop the
    row that breaks them, counted; rows are never refused on a value once reading has begun."""
    schema_path, data = files
    schema_path.write_text(edit_schema(SCHEMA))
    encoded = load_table(f"csv:{data}", load_schema(schema_path))
    assert encoded.x.shape[0] == len(encoded.y) == rows
    assert encoded.rules[f"rows_dropped_{rule}"] == count and sum(encoded.rules.values()) == count


@pytest.mark.parametrize(
    ("edit_csv", "rows", "rule"),
    [
        (lambda c: c.replace("150,blue", "old,blue"), 4, "cells_not_a_number_made_missing"),
        (lambda c: c.replace(",4,no", ",4,maybe"), 3, "rows_dropped_label_not_declared"),
        (lambda c: c.replace(",4,no", ",4,"), 3, "rows_dropped_label_missing"),
    ],
)
def test_values_the_per_record_rules_cover_are_never_refused(files, edit_csv, rows: int, rule: str) -> None:
    """Issue 23, item 7: once rows are read nothing refuses on a value; a public per-record rule
    applies (an undeclared or missing label drops the row, a cell that is not a number is missing)."""
    schema_path, data = files
    data.write_text(edit_csv(CSV), encoding="utf-8")
    encoded = load_table(f"csv:{data}", load_schema(schema_path))
    assert encoded.x.shape[0] == rows and encoded.rules[rule] == 1
    assert sum(encoded.rules.values()) == 1


def test_parquet_text_in_a_numeric_column_is_missing_not_refused(files, tmp_path: Path) -> None:
    schema_path, _ = files
    table = pa.table(
        {
            "age": ["50", "abc"], "colour": ["red", "red"], "grade": ["low", "low"], "smoker": [True, False],
            "city": ["a", "b"], "note": ["", ""], "id": [1, 2], "label": ["no", "yes"],
        }
    )  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    encoded = load_table(f"parquet:{tmp_path / 't.parquet'}", load_schema(schema_path))
    assert encoded.rules["cells_not_a_number_made_missing"] == 1  # a per-record rule, not a refusal
    assert encoded.x[1, encoded.feature_names.index("age:missing")] == 1.0


def test_parquet_typed_columns_encode_like_the_csv(files, tmp_path: Path) -> None:
    schema_path, data = files
    schema = load_schema(schema_path)
    import pyarrow.csv as pcsv

    table = pcsv.read_csv(
        data, convert_options=pcsv.ConvertOptions(null_values=["", "?", "NA"], strings_can_be_null=True)
    )
    pq.write_table(table, tmp_path / "t.parquet")
    np.testing.assert_array_equal(
        load_table(f"parquet:{tmp_path / 't.parquet'}", schema).x, load_table(f"csv:{data}", schema).x
    )


def _reviewed(draft_path: Path) -> Path:
    text = draft_path.read_text().replace("reviewed = false", "reviewed = true")
    draft_path.write_text(text)
    return draft_path


@pytest.mark.parametrize(
    ("path", "target", "ignore", "width"),
    [
        (gbsg2, "cens", ["time"], 14),
        (german_credit, "risk", [], 31),
        (actg175, "cens", ["", "pidnum", "days"], 25),
    ],
)
def test_real_tables_draft_review_encode(
    tmp_path: Path, path, target: str, ignore: list[str], width: int
) -> None:
    from veil.tables.infer import infer_schema
    from veil.tables.schema import write_schema

    source = TableSource("csv", str(path()))
    result = infer_schema(source, target=target, ignore=ignore)
    assert result.schema.reviewed is False and result.event is None
    write_schema(result.schema, tmp_path / "s.toml", result.header, result.notes)
    with pytest.raises(ConfigError, match="reviewed"):
        load_schema(tmp_path / "s.toml").require_reviewed()
    schema = load_schema(_reviewed(tmp_path / "s.toml"))
    enc = load_table(f"csv:{path()}", schema)
    assert enc.x.shape[1] == width and np.isfinite(enc.x).all() and np.abs(enc.x).max() <= 1.0
    assert len(enc.classes) == 2 and set(np.unique(enc.y)) == {0, 1}
