"""Adversarial review revJ, J5: a table CSV's row bound must be one, and passing it must not refuse.

The bound was the file's ``\\n`` count + 1, but the reader also ends a row at a lone ``\\r``: one added
row ending in CR (or one line holding rows separated by CRs) made the encoder's preallocation too
small, and every table job stopped after reading with a traceback printing the bound ("more rows than
the bound 47"). Now the bound counts line ends by the reader's own rule, in the decoded text, and the
encoder grows past a bound instead of refusing.

Planted (each seen to fail): restore the ``\\n``-only count in
:func:`veil.tables.sources.csv_reader.newline_count` and ``test_the_review_pairs_are_bounded``,
``test_the_bound_holds_for_every_mix_of_line_ends`` and both job tests (their spy sees more rows than
the bound) fail; count ``\\n`` and ``\\r`` on the bytes instead of the decoded text and
``test_the_bound_holds_in_a_codec_whose_line_end_is_not_0a`` fails (cp500); restore the
``RuntimeError`` in :meth:`veil.tables.encoder.TableEncoder.encode_batches` and
``test_a_passed_bound_gives_the_unbounded_result`` fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _budget_cli import cli
from veil.tables import encoder as encoder_module
from veil.tables.encoder import EncodedTable, TableEncoder
from veil.tables.schema import TableSchema, parse_schema
from veil.tables.sources import iter_source, parse_source
from veil.tables.sources.common import RawTable
from veil.tables.sources.csv_reader import newline_count

SCHEMA = """reviewed = true
[columns.a]
type = "numeric"
bounds = [0, 10]
[columns.y]
role = "target"
classes = ["0", "1"]
"""

ROWS = [f"{a:.2f},{y}" for a, y in zip(np.random.default_rng(0).uniform(0, 10, 48), [0, 1] * 24, strict=True)]


def _schema() -> TableSchema:
    import tomllib

    return parse_schema(tomllib.loads(SCHEMA), "test")


def _rows_read(path: Path, encoding: str = "utf-8") -> int:
    """Data rows the reader yields for the file (the quantity the bound must cover)."""
    _, batches = iter_source(parse_source(f"csv:{path}", encoding=encoding), _schema())
    return sum(raw.table.num_rows for raw in batches)


def _write_pairs(folder: Path) -> list[str]:
    """The review's pairs: D (47 rows, two ending in a lone CR) and D' (48, three); E (47 ordinary
    rows) and E' (E + one line holding four rows separated by CRs)."""

    def write(name: str, text: str) -> None:
        with open(folder / f"{name}.csv", "w", newline="") as fh:
            fh.write("a,y\n" + text)

    write("D", "".join(r + ("\r" if i < 2 else "\n") for i, r in enumerate(ROWS[:47])))
    write("Dp", "".join(r + ("\r" if i < 3 else "\n") for i, r in enumerate(ROWS[:48])))
    write("E", "".join(r + "\n" for r in ROWS[:47]))
    write("Ep", "".join(r + "\n" for r in ROWS[:47]) + "1.00,0\r2.00,1\r3.00,0\r4.00,1\n")
    (folder / "schema.toml").write_text(SCHEMA)
    return ["D", "Dp", "E", "Ep"]


def test_the_review_pairs_are_bounded(tmp_path: Path) -> None:
    for name in _write_pairs(tmp_path):
        path = tmp_path / f"{name}.csv"
        assert _rows_read(path) <= newline_count(path) - 1  # the header is a line too


LINE_END = st.sampled_from(["\n", "\r", "\r\n"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ends=st.lists(LINE_END, min_size=0, max_size=30), last=st.one_of(st.none(), LINE_END))
def test_the_bound_holds_for_every_mix_of_line_ends(
    tmp_path: Path, ends: list[str], last: str | None
) -> None:
    """Whatever ends each row (and whether the last line has an end), the reader yields no more rows
    than the bound."""
    path = tmp_path / "t.csv"
    body = "".join(f"{i % 10}.5,{i % 2}{end}" for i, end in enumerate(ends))
    with open(path, "w", newline="") as fh:
        fh.write("a,y\n" + body + ("7.5,1" + last if last is not None else "7.5,1"))
    assert _rows_read(path) <= newline_count(path)


def test_the_bound_holds_in_a_codec_whose_line_end_is_not_0a(tmp_path: Path) -> None:
    """cp500 (EBCDIC) writes a line end as byte 0x25: counted on the bytes, the bound would be 1."""
    path = tmp_path / "e.csv"
    path.write_bytes(("a,y\n" + "".join(r + "\n" for r in ROWS[:20])).encode("cp500"))
    assert b"\n" not in path.read_bytes()
    assert _rows_read(path, "cp500") == 20
    assert newline_count(path, "cp500") >= 21


def test_a_passed_bound_gives_the_unbounded_result(tmp_path: Path) -> None:
    """A bound that is too small (here 1, and 0) is no refusal: the result is the one without a bound."""
    path = tmp_path / "t.csv"
    path.write_text("a,y\n" + "".join(r + "\n" for r in ROWS) + "11,1\n5,7\n")  # clipped; dropped label
    schema = _schema()
    encoder = TableEncoder(schema)

    def encode(bound: int | None, *, drop: bool = True) -> EncodedTable:
        _, batches = iter_source(parse_source(f"csv:{path}"), schema, batch_rows=7)
        return encoder.encode_batches(bound, batches, drop=drop)

    for drop in (True, False):
        want = encode(None, drop=drop)
        for bound in (0, 1, 10**6):
            got = encode(bound, drop=drop)
            np.testing.assert_array_equal(got.x, want.x)
            np.testing.assert_array_equal(got.y, want.y)
            np.testing.assert_array_equal(got.dropped, want.dropped)
            assert got.rules == want.rules


def _spy_bounds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, int]]:
    """Every (bound, rows read) the encoder sees during a job."""
    seen: list[tuple[int | None, int]] = []
    original = encoder_module.TableEncoder.encode_batches

    def spy(self: TableEncoder, rows: int | None, batches: Iterator[RawTable], **kwargs: Any) -> EncodedTable:
        count = [0]

        def counted() -> Iterator[RawTable]:
            for raw in batches:
                count[0] += raw.table.num_rows
                yield raw

        result = original(self, rows, counted(), **kwargs)
        seen.append((rows, count[0]))
        return result

    monkeypatch.setattr(encoder_module.TableEncoder, "encode_batches", spy)
    return seen


@pytest.mark.parametrize("job", ["synth", "train"])
def test_jobs_release_on_each_pair(
    job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``veil synth`` and ``veil train --schema`` on D, D', E, E': exit 0 each, no traceback, no count
    in a message, and the bound the job passed was never exceeded."""
    seen = _spy_bounds(monkeypatch)
    for name in _write_pairs(tmp_path):
        out = tmp_path / f"{job}-{name}"
        common = ["--dataset", f"csv:{tmp_path / name}.csv", "--schema", str(tmp_path / "schema.toml"),
                  "--epsilon", "1", "--out", str(out)]  # fmt: skip
        extra = ["--rows", "20", "--bins", "4"] if job == "synth" else ["--delta", "1e-4", "--epochs", "1"]
        code, stdout, err = cli(capsys, job, *common, *extra)
        assert code == 0, err
        assert "Traceback" not in err and "bound" not in stdout + err
        assert (out / "release").is_dir()
    assert seen and all(rows is not None and read <= rows for rows, read in seen), seen
