"""``veil schema infer``: draft a table's schema from the data, or release it with DP.

Two modes, told apart in the written file by its ``reviewed`` key:

* Draft (``reviewed = false``, no privacy cost, **not private**): types from the stored column
  types, bounds = the observed min and max, levels and classes = the observed values. Each column
  carries a comment with what was read. Training refuses the draft until a person has replaced every
  data-derived fact by public knowledge and set ``reviewed = true``.
* DP release (``--epsilon E``, ``reviewed = "dp"``): every fact is released by an accounted mechanism
  of :mod:`veil.tables.release` under add/remove-one-row neighbouring. The budget ``E`` is split
  evenly over the ``k`` columns read (one row touches all of them, so the costs add up): a feature
  column spends ``E/(4k)`` on its noisy kind counts (number/text/missing: a column is numeric when
  its noisy number count is at least its noisy text count) and ``3E/(4k)`` on either DP bounds
  (numeric) or a thresholded histogram of levels (text); the target spends ``E/k`` on its classes'
  histogram. The histograms' threshold δ is split evenly too (``δ/k`` each). Total: pure ε ≤ E plus
  δ — the ``[dp]`` table of the schema records both and the events. Missing values always get an
  indicator (that choice reads nothing). A rare value is not released: it falls into the column's
  unknown level, and a rare class is left out (training then refuses rows of that class, by name).

Columns passed with ``ignore`` are written as ``type = "ignored"`` and never read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.defaults import DEFAULT_RELEASE_DELTA
from veil.accounting.events import Composed, DeltaOnly, Laplace, PrivacyEvent, SelfComposed
from veil.errors import DataError, InvalidParameterError
from veil.tables.schema import BOOLEAN_FALSE, BOOLEAN_TRUE, DEFAULT_MISSING_VALUES, ColumnSpec, TableSchema
from veil.tables.sources.cells import number_text

if TYPE_CHECKING:
    import pyarrow as pa

    from veil.mechanisms.rng import RandomSource
    from veil.tables.sources import TableSource

__all__ = ["InferResult", "dp_plan", "infer_schema"]

MAX_LEVELS = 100
"""A text column with more distinct values than this is not drafted as categorical."""
EMBED_ABOVE = 30
"""Categoricals with more levels than this are drafted with ``encoding = "embedding"``."""
TEXT_MEAN_LENGTH = 20
_NUMBER_RE = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"


@dataclass
class InferResult:
    schema: TableSchema
    header: list[str]
    notes: dict[str, str] = field(default_factory=dict)
    event: PrivacyEvent | None = None
    epsilon: float = 0.0
    delta: float = 0.0
    review: dict[str, str] = field(default_factory=dict)
    """Columns whose facts need a human decision, and why (from released values only)."""


def infer_schema(
    source: TableSource,
    *,
    target: str,
    epsilon: float | None = None,
    delta: float = DEFAULT_RELEASE_DELTA,
    ignore: Sequence[str] = (),
    max_levels: int = MAX_LEVELS,
    rng: RandomSource | None = None,
    spent: list[PrivacyEvent] | None = None,
    privacy_unit: str | None = None,
) -> InferResult:
    """Draft (``epsilon=None``) or DP-release (``epsilon=E``) the schema of ``source``.

    ``spent``: a list that receives each release's event (and each threshold's
    :class:`~veil.accounting.events.DeltaOnly`) as soon as it is released, for the budget registry;
    on an error part-way it holds exactly what was released. ``privacy_unit``: the column naming each
    row's person, written ``type = "ignored"``; a DP release then protects people
    (:func:`one_row_per_unit`)."""
    names = check_columns_named(source, target, ignore, privacy_unit)
    if privacy_unit is not None:
        ignore = [*ignore, privacy_unit] if privacy_unit not in ignore else list(ignore)
    read = [n for n in names if n not in ignore]
    if epsilon is not None:
        return _infer_dp(
            source, names, read, target, epsilon, delta, ignore, max_levels, rng, spent, privacy_unit
        )
    table = _read(source, read)
    if table.count == 0:  # the draft is non-private by construction: a plain message is fine here
        raise DataError(
            "dataset", source.describe(), "the table has no data rows", "provide a table with rows"
        )
    columns: list[ColumnSpec] = []
    notes: dict[str, str] = {}
    for name in names:
        if name in ignore:
            columns.append(ColumnSpec(name, "ignored"))
            continue
        spec, note = _draft_column(name, table.column(name), name == target, max_levels)
        columns.append(spec)
        notes[name] = note
    header = [
        f"Drafted by `veil schema infer` from {source.describe()}.",
        "NOT PRIVATE: the bounds, levels and classes below were read from the data itself.",
        "Training refuses this draft. Review every column: keep only facts that are public knowledge",
        "(a codebook, a form, a standard), widen bounds to their public range, add or remove levels,",
        'mark columns not to be used as type = "ignored"; then set reviewed = true.',
        "Or let veil release them privately: veil schema infer ... --epsilon E.",
    ]
    return InferResult(TableSchema(tuple(columns), reviewed=False), header, notes)


def check_columns_named(
    source: TableSource, target: str, ignore: Sequence[str], privacy_unit: str | None = None
) -> list[str]:
    """The source's column names (its header or metadata, no row), after checking that the target,
    the ignored columns and the unit column are among them: ``veil schema infer --epsilon`` runs it
    before the registry is charged, so a typo is refused for free."""
    from veil.tables.sources import source_columns

    names = source_columns(source)
    if privacy_unit is not None:
        _check_names(names, privacy_unit, (), source.describe())
    _check_names(names, target, ignore, source.describe())
    return names


def _check_names(names: list[str], target: str, ignore: Sequence[str], where: str) -> None:
    import difflib

    for n in [target, *ignore]:
        if n not in names:
            close = difflib.get_close_matches(n, names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise DataError(
                "column", n, f"there is no such column in {where}", f"{hint}columns: {', '.join(names[:20])}"
            )
    if target in ignore:
        raise DataError("target", target, "the target cannot also be ignored", "drop it from --ignore")


class _Columns:
    """One column at a time: Parquet columns are read on demand (a table larger than memory is
    inferred column by column); CSV and SQL sources are read once."""

    def __init__(self, source: TableSource, columns: list[str]) -> None:
        self.source = source
        self.rows: np.ndarray | None = None  # the rows to keep (one per privacy unit), or None: all
        self.table: pa.Table | None = None
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            self.parquet = pq.ParquetFile(source.location)
            count = int(self.parquet.metadata.num_rows)
        elif source.kind == "csv":  # every cell as written: Arrow's per-column type guess is not used
            import pyarrow as pa

            from veil.tables.sources.csv_reader import read_csv_text

            cells = read_csv_text(source)
            self.table = pa.table({n: pa.array(cells[n], pa.string()) for n in columns})
            count = self.table.num_rows
        else:
            from veil.tables.sources import read_source

            self.table = read_source(source).table.select(columns)
            count = self.table.num_rows
        # count 0 is no refusal here: with --epsilon, zero rows take the path of one row (noisy
        # releases of zero counts, then the post-processing check on what they found), so N = 0 and
        # N = 1 get the same message and the same charge
        self.count = count

    def column(self, name: str) -> pa.ChunkedArray:
        if self.table is not None:
            column = self.table.column(name)
        else:
            column = self.parquet.read(columns=[name]).column(0)
        return column if self.rows is None else column.take(self.rows)


def _read(source: TableSource, columns: list[str]) -> _Columns:
    return _Columns(source, columns)


def unit_ids(source: TableSource, column: str) -> list[object]:
    """Each row's unit id as text, ``None`` where missing: read as the other jobs read it.

    A CSV's unit cells are taken as written (the train, tune, synth and federated readers read the
    unit column as text), never through type inference: inferred as numbers, ``007``, ``7`` and
    ``7.0`` — or two 20-digit ids beyond float precision — would be one unit here and several
    elsewhere, and one drawn row per merged "unit" would protect those people only as a replacement
    of a row, not as the add/remove-one-unit the release is stated for. A default missing-value
    marker (``""``, ``?``, ``NA``) is missing, as in the schema readers. Other sources keep their
    stored types (the same cells the other jobs read)."""
    if source.kind == "csv":
        from veil.tables.sources.csv_reader import read_csv_text

        return [None if v in DEFAULT_MISSING_VALUES else v for v in read_csv_text(source)[column]]
    from veil.tables.units import unit_texts

    return list(unit_texts(_Columns(source, [column]).column(column)))


def one_row_per_unit(unit_ids: list[object], rng: RandomSource) -> np.ndarray:
    """The rows a DP schema release reads with a privacy unit: one uniformly drawn row of each unit.

    Guarantee (add/remove one unit). Each unit's row is drawn from ``rng`` independently of the data's
    values and of the other units; under the coupling that keeps every other unit's draw, adding or
    removing a unit adds or removes exactly one row of the selected table. So every row-level release
    below (kind counts, bounds, thresholded levels), run on the selection, is (ε, δ)-DP for people
    (convexity over the draws). Rows without a unit id belong to nobody and are not selected."""
    keys = np.array([str(v) if v is not None else "" for v in unit_ids], dtype=object)
    known = np.array([v is not None for v in unit_ids], dtype=bool)
    order = np.argsort(np.asarray(rng.standard_normal(len(keys))), kind="stable")  # a uniform shuffle
    order = order[known[order]]
    _, first = np.unique(keys[order], return_index=True)  # the first row of each unit in that order
    return np.sort(order[first]).astype(np.int64)


# -- column views -------------------------------------------------------------------------------


def _cells(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str | None], np.ndarray]:
    """(finite numbers, text cells or None, missing mask): each cell is a number, a text or missing,
    by a rule on the cell alone.

    Why on the cell alone: these counts feed the DP release (kind counts, bounds, level histograms
    with sensitivity 1). Sorting cells by the column's type let one record move every other: a CSV
    column of reals read as text once one cell was ``"x"`` (its ``nan`` cells turned from missing into
    text), booleans written ``true`` or ``True`` depending on another row. So every cell is first its
    text by :func:`veil.tables.sources.cells.column_texts` (a CSV is read as written), then: missing
    when null, a default marker (``""``, ``?``, ``NA``) or NaN; a number when it reads as a finite
    number; an infinity is neither (it has no bound and no level); anything else text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from veil.tables.sources.cells import column_texts

    if pa.types.is_null(column.type):
        return np.array([]), [], np.ones(len(column), dtype=bool)
    text = pc.utf8_trim_whitespace(column_texts(column))
    values = text.to_pylist()
    missing = np.array(
        [v is None or v in DEFAULT_MISSING_VALUES or v.lower() in _NAN_TEXTS for v in values], dtype=bool
    )
    infinite = np.array([v is not None and v.lower() in _INFINITY_TEXTS for v in values], dtype=bool)
    is_number = (
        np.asarray(
            pc.fill_null(pc.match_substring_regex(text, _NUMBER_RE), False).to_numpy(zero_copy_only=False),
            dtype=bool,
        )
        & ~missing
    )
    numbers = np.array([float(values[i]) for i in np.flatnonzero(is_number)], dtype=np.float64)
    words = [None if (missing[i] or is_number[i] or infinite[i]) else values[i] for i in range(len(values))]
    return numbers[np.isfinite(numbers)], words, missing


_NAN_TEXTS = frozenset({"nan", "+nan", "-nan"})
_INFINITY_TEXTS = frozenset({"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})


def _value_counts(numbers: np.ndarray, words: list[str | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in numbers.tolist():
        key = number_text(v)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    for w in words:
        if w is not None:
            counts[w] = counts.get(w, 0) + 1
    return counts


def _sorted_levels(levels: Sequence[str]) -> tuple[str, ...]:
    def key(v: str) -> tuple[int, float, str]:
        try:
            return (0, float(v), v)
        except ValueError:
            return (1, 0.0, v)

    return tuple(sorted(levels, key=key))


def _boolean(levels: Sequence[str]) -> bool:
    low = {v.lower() for v in levels}
    return 1 <= len(low) <= 2 and (low <= set(BOOLEAN_TRUE + BOOLEAN_FALSE)) and not low <= {"0", "1"}


def _text_column(name: str, levels: tuple[str, ...], missing: str) -> ColumnSpec:
    if _boolean(levels):
        return ColumnSpec(name, "boolean", missing=missing)  # type: ignore[arg-type]
    encoding = "embedding" if len(levels) > EMBED_ABOVE else "onehot"
    return ColumnSpec(name, "categorical", levels=levels, missing=missing, encoding=encoding)  # type: ignore[arg-type]


# -- draft --------------------------------------------------------------------------------------


def _draft_column(
    name: str, column: pa.ChunkedArray, is_target: bool, max_levels: int
) -> tuple[ColumnSpec, str]:
    numbers, words, missing = _cells(column)
    n_missing = int(missing.sum())
    policy = "indicator" if n_missing else "drop"
    seen = f"{n_missing} missing" if n_missing else "no missing value"
    n_words = sum(w is not None for w in words)
    if is_target:
        classes = _sorted_levels(list(_value_counts(numbers, words)))
        return ColumnSpec(name, "categorical", "target", levels=classes, unknown="drop"), (
            f"target: {len(classes)} classes seen ({seen})"
        )
    if numbers.size and n_words == 0:
        lo, hi = float(numbers.min()), float(numbers.max())
        if not lo < hi:
            hi = lo + 1.0
        spec = ColumnSpec(name, "numeric", bounds=(lo, hi), missing=policy)  # type: ignore[arg-type]
        return spec, f"numeric: seen min {lo:g}, max {float(numbers.max()):g} ({seen})"
    counts = _value_counts(numbers, words)
    if not counts:
        return ColumnSpec(name, "ignored"), "every value is missing"
    if len(counts) <= max_levels:
        levels = _sorted_levels(list(counts))
        return _text_column(name, levels, policy), f"{len(levels)} distinct values seen ({seen})"
    mean_len = float(np.mean([len(k) for k in counts]))
    if mean_len >= TEXT_MEAN_LENGTH:
        return ColumnSpec(
            name, "text"
        ), f"{len(counts)} distinct values, mean length {mean_len:.0f}: free text?"
    return ColumnSpec(name, "ignored"), (
        f"{len(counts)} distinct values: an identifier? (declare it categorical with public levels to use it)"
    )


# -- DP release ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BudgetSplit:
    """How ``schema infer --epsilon`` splits (ε, δ): ε/k and δ/k per column read; a feature column
    spends a quarter of its share on the noisy kind counts and the rest on its bounds or levels. One
    place, so the registry's reservation (:func:`dp_plan`) and the release (:func:`_infer_dp`) agree."""

    column: float
    delta: float
    kinds: float
    rest: float


def _budget_split(epsilon: float, delta: float, columns: int) -> _BudgetSplit:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise InvalidParameterError(
            "epsilon", epsilon, "the release needs a finite budget ε > 0", "pass ε > 0"
        )
    if not (0 < delta < 1):
        raise InvalidParameterError("delta", delta, "the thresholds' δ must lie in (0, 1)", "pass e.g. 1e-7")
    column = epsilon / columns
    return _BudgetSplit(column, delta / columns, column / 4, column * 3 / 4)


def _infer_dp(
    source: TableSource,
    names: list[str],
    read: list[str],
    target: str,
    epsilon: float,
    delta: float,
    ignore: Sequence[str],
    max_levels: int,
    rng: RandomSource | None,
    released: list[PrivacyEvent] | None = None,
    privacy_unit: str | None = None,
) -> InferResult:
    from veil.mechanisms.rng import make_source
    from veil.tables.release import dp_bounds, noisy_kind_counts, scale_for, thresholded_levels

    split = _budget_split(epsilon, delta, len(read))
    rng = rng or make_source(True)
    table = _read(source, read)
    if privacy_unit is not None:  # people, not rows: one drawn row per unit (one_row_per_unit)
        ids = unit_ids(source, privacy_unit)
        table.rows = one_row_per_unit(ids, rng)
    eps_col, delta_col, rest = split.column, split.delta, split.rest
    kind_scale = scale_for(split.kinds, rng.secure)
    events: list[PrivacyEvent] = []
    charged = released if released is not None else []

    def record(event: PrivacyEvent, threshold_delta: float | None = None) -> None:
        events.append(event)
        charged.append(event)
        if threshold_delta is not None:
            charged.append(DeltaOnly(threshold_delta))

    columns: list[ColumnSpec] = []
    notes: dict[str, str] = {}
    review: dict[str, str] = {}
    for name in names:
        if name in ignore:
            columns.append(ColumnSpec(name, "ignored"))
            continue
        numbers, words, missing = _cells(table.column(name))
        if name == target:
            release = thresholded_levels(_value_counts(numbers, words), eps_col, delta_col, rng, max_levels)
            record(release.event, release.threshold_delta)
            columns.append(ColumnSpec(name, "categorical", "target", levels=_sorted_levels(release.levels)))
            notes[name] = f"target: classes released by a thresholded noisy histogram (ε = {eps_col:.4g})"
            continue
        n_words = sum(w is not None for w in words)
        noisy, event = noisy_kind_counts(numbers.size, n_words, int(missing.sum()), kind_scale, rng)
        record(event)
        if noisy[0] >= noisy[1]:
            bounds = dp_bounds(numbers, rest, rng, rows_hint=float(noisy[0]))  # r from a released count
            record(bounds.event)
            columns.append(ColumnSpec(name, "numeric", bounds=(bounds.low, bounds.high)))
            notes[name] = (
                f"numeric: bounds from a noisy histogram on a grid of round numbers (ε = {rest:.4g}; "
                f"a cell counts from about {bounds.threshold:.0f} values; 1 % trimmed at each end)"
            )
            if bounds.needs_review:
                review[name] = bounds.needs_review
                notes[name] += f"; REVIEW: {bounds.needs_review}"
            continue
        release = thresholded_levels(_value_counts(np.array([]), words), rest, delta_col, rng, max_levels)
        record(release.event, release.threshold_delta)
        if not release.levels:
            columns.append(ColumnSpec(name, "ignored"))
            notes[name] = "text: no value frequent enough to be released; ignored"
            continue
        columns.append(_text_column(name, _sorted_levels(release.levels), "indicator"))
        notes[name] = f"text: levels released by a thresholded noisy histogram (ε = {rest:.4g})"
    target_spec = next(c for c in columns if c.role == "target")
    if len(target_spec.levels) < 2:
        raise DataError(
            "target",
            target,
            f"the DP release found {len(target_spec.levels)} class(es) frequent enough to publish "
            f"(the budget ε = {epsilon:g} was spent)",
            "declare the public list of classes by hand in a reviewed schema, or use more data",
        )
    composed = Composed(events)
    spent = _pure_epsilon(composed)
    dp = {
        "epsilon": spent,
        "delta": delta,
        "neighbouring": "add_or_remove_one" if privacy_unit is None else "add_or_remove_one_unit",
        **({} if privacy_unit is None else {"privacy_unit": privacy_unit}),
        "mechanisms": "noisy kind counts, bounds from a noisy histogram on a public grid, thresholded "
        "noisy histograms (Laplace)",
        "randomness": "secure" if rng.secure else "seeded",
        "events": json.dumps(composed.to_dict(), sort_keys=True),
    }
    schema = TableSchema(tuple(columns), reviewed="dp", dp=dp)
    header = [
        f"Released by `veil schema infer --epsilon {epsilon:g}` from {source.describe()}.",
        f"DP: pure ε = {spent:.6g} plus δ = {delta:g} (thresholds), add/remove one "
        + ("row" if privacy_unit is None else f"person (unit column `{privacy_unit}`, all their rows)")
        + "; see [dp].",
        "Usable as it is. Editing it with public knowledge keeps the guarantee; adding facts read from",
        "the data does not (then it is a draft again: set reviewed = false).",
    ]
    return InferResult(schema, header, notes, composed, spent, delta, review)


def dp_plan(
    read: Sequence[str], target: str, epsilon: float, delta: float, secure: bool
) -> list[PrivacyEvent]:
    """Every release :func:`infer_schema` with ``epsilon`` may make on the columns ``read``, known
    before a row is read (the budget registry's reservation).

    Which of a feature column's two releases runs — DP bounds or a levels histogram — depends on its
    noisy kind counts, so the plan holds both (composition never lowers ε when an event is added, in
    either accountant, so the plan bounds whatever runs); each histogram's threshold δ is a
    :class:`~veil.accounting.events.DeltaOnly`. The registry settles the run to what was released.
    """
    from veil.tables.release import bounds_plan, release_event, scale_for

    split = _budget_split(epsilon, delta, len(read))
    eps_col, delta_col, rest = split.column, split.delta, split.rest
    plan: list[PrivacyEvent] = []
    for name in read:
        if name == target:
            plan += [release_event(scale_for(eps_col, secure), secure), DeltaOnly(delta_col)]
            continue
        plan += [
            release_event(scale_for(split.kinds, secure), secure),
            bounds_plan(rest, secure),
            release_event(scale_for(rest, secure), secure),
            DeltaOnly(delta_col),
        ]
    return plan


def _pure_epsilon(event: PrivacyEvent) -> float:
    if isinstance(event, Laplace):
        return event.pure_epsilon
    if isinstance(event, SelfComposed):
        return event.count * _pure_epsilon(event.event)
    if isinstance(event, Composed):
        return math.fsum(_pure_epsilon(e) for e in event.events)
    raise TypeError(type(event).__name__)


def describe(result: InferResult) -> dict[str, Any]:
    """A summary for the CLI: what was written and at what cost."""
    kinds: dict[str, int] = {}
    for c in result.schema.columns:
        key = "target" if c.role == "target" else c.type
        kinds[key] = kinds.get(key, 0) + 1
    return {
        "reviewed": result.schema.reviewed,
        "columns": len(result.schema.columns),
        **{f"{k} columns": v for k, v in kinds.items()},
        "epsilon": result.epsilon if result.event is not None else "not private (a draft to review)",
        "delta": result.delta if result.event is not None else "-",
        "needs a human decision": _review_summary(result),
    }


def _review_summary(result: InferResult) -> str:
    """Which columns' facts a person must decide, and why: every one of a draft; a DP release's flagged
    bounds (a short table, a bound at the grid's edge)."""
    if result.event is None:
        return "every column: a draft's bounds, levels and classes were read from the data"
    if not result.review:
        return "none: every bound released is usable as it is"
    return "; ".join(f"{name}: {why}" for name, why in result.review.items())
