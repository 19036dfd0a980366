"""The privacy-unit column of a table: checked before a row is read, read as an identifier only.

The unit column (``--privacy-unit COLUMN``) names the person each row belongs to. It is an
identifier, not data to learn from: the schema must declare it ``type = "ignored"`` (so the encoder
never makes a feature of it), its values are read as text and are turned into keyed hashes by the
split (:func:`veil.data.unit_hashes`) before anything else sees them, and no message ever prints one.
A row whose unit cell is missing cannot be attributed to anyone: it is dropped by a per-record
public rule (it belongs to no unit, so it contributes nothing), never refused after reading.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from veil.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.tables.schema import TableSchema


class _HasTable(Protocol):
    """A batch as read (:class:`veil.tables.sources.RawTable`); named by shape so that this module,
    which :mod:`veil.tables.sources` imports, does not import it back."""

    @property
    def table(self) -> pa.Table: ...


_Batch = TypeVar("_Batch", bound=_HasTable)

__all__ = ["check_unit_column", "collect_units", "unit_texts"]


def check_unit_column(schema: TableSchema, present: Sequence[str], column: str, where: str) -> None:
    """Refuse, from the header and the schema alone, a unit column that is absent or is data."""
    if column not in present:
        raise DataError(
            "privacy_unit",
            column,
            f"the unit column is not a column of {where}, so rows cannot be grouped by person",
            "name an existing column with --privacy-unit (the column holding the person's id)",
        )
    spec = next((c for c in schema.columns if c.name == column), None)
    if spec is None or spec.type != "ignored" or spec.role != "feature":
        declared = "not declared" if spec is None else f'declared type = "{spec.type}", role = "{spec.role}"'
        raise ConfigError(
            "privacy_unit",
            column,
            f"the unit column is an identifier and must never be a feature or the label ({declared})",
            f'declare it in the schema as [columns."{column}"] type = "ignored"',
        )


def unit_texts(values: pa.ChunkedArray | pa.Array) -> list[object]:
    """Each cell of a unit column as text (``None`` if missing): a function of that cell alone.

    The rule of :mod:`veil.tables.sources.cells` (``column_texts``): text as stored; bytes (a Parquet
    ``binary`` column) as their hexadecimal digits — one-to-one, so two people's byte ids never become
    one text, and a byte string that is not UTF-8 is still an id (never a failure after reading on one
    person's value); a number by ``number_text`` (``10**15`` is ``"1000000000000000"`` whether the
    column holds integers or reals: Arrow's cast wrote ``"1e+15"`` once another person's id made the
    column real, moving this person's key and side of the split); a floating-point NaN is missing
    like a null (rows without a unit belong to no one)."""
    import pyarrow as pa

    from veil.tables.sources.cells import column_texts

    column = values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])
    return list(column_texts(column).to_pylist())


def collect_units(batches: Iterator[_Batch], column: str, into: list[Any]) -> Iterator[_Batch]:
    """Pass ``batches`` through, appending each row's unit id (text, ``None`` if missing) to ``into``."""
    for raw in batches:
        into.extend(unit_texts(raw.table.column(column)))
        yield raw
