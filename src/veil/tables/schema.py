"""A table's declared schema: per column its role, type and public domain, read from a TOML file.

Why a schema. Everything a model needs to know about a table before it sees a row — which column is
the label and which classes it can take, the levels of each categorical column, the range of each
numeric one — is a fact about the private data unless someone declares it. The schema is that
declaration. Its top-level key ``reviewed`` says where the facts came from:

* ``false`` — a draft written by ``veil schema infer`` from the data itself, *not* private: the
  levels and bounds in it were read off the rows. Training refuses it until a person has checked
  that every level, bound and class is public knowledge (a codebook, a form, a standard) and set
  ``reviewed = true``.
* ``true`` — declared public by the user; no privacy cost.
* ``"dp"`` — released by ``veil schema infer --epsilon`` with accounted DP mechanisms (see
  :mod:`veil.tables.release`); the ``[dp]`` table records ε, δ and the mechanisms, and the cost is
  the dataset's to carry.

File layout (column order in the file is the encoding order)::

    reviewed = false
    missing_values = ["", "?", "NA"]     # text cells read as missing
    csv_multiline_values = false         # true: a quoted CSV value may span lines (see below)

    [columns.age]
    type = "numeric"
    bounds = [20.0, 80.0]
    outside = "clip"        # or "drop": a row with a value outside the bounds is dropped
    missing = "indicator"   # or "drop": a row with a missing value is dropped

    [columns.grade]
    type = "ordinal"        # levels in order
    levels = ["I", "II", "III"]
    unknown = "level"       # or "drop": a row with a value not among the levels is dropped

    [columns.housing]
    type = "categorical"
    levels = ["free", "own", "rent"]
    encoding = "onehot"     # or "embedding" (wide categoricals)

    [columns.smoker]
    type = "boolean"

    [columns.notes]
    type = "text"           # kept for text models; the tabular encoder does not use it

    [columns.id]
    type = "ignored"

    [columns.risk]
    role = "target"
    classes = ["bad", "good"]

Every column of the data must be listed (``type = "ignored"`` for those not used), so nothing is
used undeclared. Unknown keys are refused by name.

``"drop"`` is a public per-record rule, never a refusal: the row is left out of the encoded table and
counted (see :mod:`veil.tables.encoder`). ``"error"``, the policy's name before rows stopped being
refused after reading, is still accepted and read as ``"drop"``.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from veil.errors import ConfigError

__all__ = [
    "DEFAULT_MISSING_VALUES",
    "ColumnSpec",
    "TableSchema",
    "load_schema",
    "parse_schema",
    "schema_to_toml",
    "write_schema",
]

ColumnType = Literal["numeric", "categorical", "ordinal", "boolean", "text", "ignored"]
Role = Literal["feature", "target"]
Reviewed = Literal[False, True, "dp"]
COLUMN_TYPES: tuple[str, ...] = ("numeric", "categorical", "ordinal", "boolean", "text", "ignored")
DEFAULT_MISSING_VALUES: tuple[str, ...] = ("", "?", "NA")
BOOLEAN_TRUE = ("true", "t", "yes", "y", "1")
BOOLEAN_FALSE = ("false", "f", "no", "n", "0")

_COLUMN_KEYS = {
    "numeric": {"type", "role", "bounds", "outside", "missing"},
    "categorical": {"type", "role", "levels", "unknown", "missing", "encoding"},
    "ordinal": {"type", "role", "levels", "unknown", "missing"},
    "boolean": {"type", "role", "unknown", "missing"},
    "text": {"type", "role"},
    "ignored": {"type", "role"},
}
_TARGET_KEYS = {"role", "classes"}
_TOP_KEYS = {"reviewed", "missing_values", "csv_multiline_values", "columns", "dp"}


@dataclass(frozen=True)
class ColumnSpec:
    """One column: its role, type and declared domain, and what to do with values outside it."""

    name: str
    type: ColumnType
    role: Role = "feature"
    bounds: tuple[float, float] | None = None
    """numeric: public [low, high]; values are clipped to it (``outside = "clip"``) or their row is
    dropped (``"drop"``)."""
    levels: tuple[str, ...] = ()
    """categorical / ordinal levels; the target's classes (in order: class index = position)."""
    outside: Literal["clip", "drop", "error"] = "clip"
    unknown: Literal["level", "drop", "error"] = "level"
    """A value not among the levels: its own "unknown" level, or its row dropped."""
    missing: Literal["indicator", "drop", "error"] = "indicator"
    """A missing value: a 0/1 indicator feature (value set to the middle), or its row dropped."""
    encoding: Literal["onehot", "embedding"] = "onehot"

    def __post_init__(self) -> None:
        for key in ("outside", "unknown", "missing"):  # the old name of "drop" (see the module docstring)
            if getattr(self, key) == "error":
                object.__setattr__(self, key, "drop")

    @property
    def used(self) -> bool:
        """Whether the tabular encoder reads this column (features of a tabular type, and the target)."""
        return self.role == "target" or self.type not in ("text", "ignored")


@dataclass(frozen=True)
class TableSchema:
    """The declared schema of a table (see the module docstring)."""

    columns: tuple[ColumnSpec, ...]
    reviewed: Reviewed = False
    missing_values: tuple[str, ...] = DEFAULT_MISSING_VALUES
    dp: Mapping[str, Any] = field(default_factory=dict)
    """For ``reviewed = "dp"``: epsilon, delta and the mechanisms of the release."""
    csv_multiline_values: bool = False
    """A CSV's quoted value may span lines (declared; default: one physical line is one record, see
    :mod:`veil.tables.sources.csv_reader` for the risk)."""

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConfigError("schema column", dup, "a column is declared twice", "declare it once")
        targets = [c.name for c in self.columns if c.role == "target"]
        if len(targets) > 1:
            raise ConfigError(
                "schema target",
                ", ".join(targets),
                "more than one column has role = 'target'",
                "keep role = 'target' on the label column only",
            )

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def target(self) -> ColumnSpec | None:
        return next((c for c in self.columns if c.role == "target"), None)

    @property
    def features(self) -> list[ColumnSpec]:
        """The columns the tabular encoder turns into features, in file order."""
        return [c for c in self.columns if c.role == "feature" and c.used]

    def column(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def require_target(self, where: str) -> ColumnSpec:
        """The target column, or a :class:`ConfigError` saying how to declare one."""
        t = self.target
        if t is None:
            raise ConfigError(
                "schema target",
                None,
                f"{where} needs a label column with its public list of classes",
                "add role = 'target' and classes = [...] to the label column's table in the schema",
            )
        return t

    def require_reviewed(self, path: str = "the schema") -> None:
        """Refuse a draft: its levels, bounds and classes were read from the private rows."""
        if self.reviewed is True or self.reviewed == "dp":
            return
        raise ConfigError(
            "reviewed",
            self.reviewed,
            f"{path} is a draft whose levels, bounds and classes were read from the private data; "
            "training on it would publish them through the model without any guarantee",
            "check that every numeric bound, categorical level and target class is public knowledge "
            "(a codebook, a form, a standard; widen bounds and add levels as needed, remove any that only "
            "this data reveals), then set reviewed = true; or draft it privately with "
            "`veil schema infer --epsilon E`",
        )

    def with_reviewed(self, value: Reviewed) -> TableSchema:
        return replace(self, reviewed=value)


# -- parsing ------------------------------------------------------------------------------------


def _where(name: str, key: str) -> str:
    return f"columns.{name}.{key}"


def _choice(name: str, key: str, raw: Mapping[str, Any], options: Sequence[str], default: str) -> Any:
    value = raw.get(key, default)
    if value not in options:
        raise ConfigError(
            _where(name, key), value, "this setting decides what happens to a value", f"use one of {options}"
        )
    return value


def _levels(name: str, key: str, value: Any, minimum: int) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, bool)) for v in value):
        raise ConfigError(
            _where(name, key),
            value,
            "the public domain must be a list of values",
            f'write {key} = ["a", "b", ...]',
        )
    levels = tuple(_level_text(v) for v in value)
    if len(levels) < minimum:
        raise ConfigError(
            _where(name, key),
            value,
            f"at least {minimum} value(s) are needed",
            f"list every public value in {key}",
        )
    if len(set(levels)) != len(levels):
        dup = next(v for v in levels if levels.count(v) > 1)
        raise ConfigError(_where(name, key), dup, "a value is listed twice", "list each value once")
    return levels


def _level_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _bounds(name: str, value: Any) -> tuple[float, float]:
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )
    if not ok or not all(math.isfinite(v) for v in value) or not value[0] < value[1]:
        raise ConfigError(
            _where(name, "bounds"),
            value,
            "a numeric column needs public, finite bounds to be scaled without reading the data",
            "write bounds = [low, high] with low < high",
        )
    return float(value[0]), float(value[1])


def _column(name: str, raw: Any) -> ColumnSpec:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"columns.{name}", raw, "each column is a table of settings", f"write [columns.{name}]"
        )
    role = raw.get("role", "feature")
    if role not in ("feature", "target"):
        raise ConfigError(_where(name, "role"), role, "unknown role", "use 'feature' (default) or 'target'")
    if role == "target":
        _refuse_unknown(name, raw, _TARGET_KEYS)
        if "classes" not in raw:
            raise ConfigError(
                _where(name, "classes"),
                None,
                "the label set sets the model's output width and must be public, not read from the data",
                'declare classes = ["...", "..."] for the target column',
            )
        return ColumnSpec(
            name, "categorical", "target", levels=_levels(name, "classes", raw["classes"], 2), unknown="drop"
        )
    ctype = raw.get("type")
    if ctype not in COLUMN_TYPES:
        import difflib

        close = difflib.get_close_matches(str(ctype), COLUMN_TYPES, n=1) if ctype is not None else []
        raise ConfigError(
            _where(name, "type"),
            ctype,
            "every column needs a type" if ctype is None else f"{ctype!r} is not a column type",
            (f"did you mean {close[0]!r}? " if close else "") + f"use one of {COLUMN_TYPES}",
        )
    _refuse_unknown(name, raw, _COLUMN_KEYS[ctype])
    spec = ColumnSpec(name, ctype)
    if ctype == "numeric":
        if "bounds" not in raw:
            _bounds(name, None)
        spec = replace(
            spec,
            bounds=_bounds(name, raw["bounds"]),
            outside=_choice(name, "outside", raw, ("clip", "drop", "error"), "clip"),
        )
    if ctype in ("categorical", "ordinal"):
        spec = replace(
            spec,
            levels=_levels(name, "levels", raw.get("levels"), 1),
            encoding=_choice(name, "encoding", raw, ("onehot", "embedding"), "onehot"),
        )
    if ctype in ("categorical", "ordinal", "boolean"):
        spec = replace(spec, unknown=_choice(name, "unknown", raw, ("level", "drop", "error"), "level"))
    if ctype in ("numeric", "categorical", "ordinal", "boolean"):
        spec = replace(
            spec, missing=_choice(name, "missing", raw, ("indicator", "drop", "error"), "indicator")
        )
    return spec


def _refuse_unknown(name: str, raw: Mapping[str, Any], allowed: set[str]) -> None:
    import difflib

    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                _where(name, key),
                raw[key],
                "unknown key: a typo must not fall back silently to a default",
                f"{hint}allowed here: {', '.join(sorted(allowed))}",
            )


def parse_schema(data: Mapping[str, Any], source: str = "schema") -> TableSchema:
    """Build and validate a :class:`TableSchema` from parsed TOML."""
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"{source}: {key}",
                data[key],
                "unknown top-level key",
                f"allowed: {', '.join(sorted(_TOP_KEYS))}; columns go in [columns.NAME] tables",
            )
    reviewed = data.get("reviewed", False)
    if reviewed not in (False, True, "dp") or (isinstance(reviewed, int) and not isinstance(reviewed, bool)):
        raise ConfigError(
            "reviewed", reviewed, "it says where the schema's facts came from", 'use false, true or "dp"'
        )
    if reviewed == "dp" and not isinstance(data.get("dp"), dict):
        raise ConfigError(
            "reviewed",
            "dp",
            "a DP-released schema must record its release ([dp] with epsilon and delta)",
            "re-run `veil schema infer --epsilon E`, or review it and set reviewed = true",
        )
    columns = data.get("columns")
    if not isinstance(columns, dict) or not columns:
        raise ConfigError(
            f"{source}: columns", columns, "a schema declares its columns", "add [columns.NAME] tables"
        )
    missing = data.get("missing_values", list(DEFAULT_MISSING_VALUES))
    if not isinstance(missing, list) or not all(isinstance(v, str) for v in missing):
        raise ConfigError(
            "missing_values", missing, "the text cells read as missing must be listed", 'e.g. ["", "?", "NA"]'
        )
    multiline = data.get("csv_multiline_values", False)
    if not isinstance(multiline, bool):
        raise ConfigError(
            "csv_multiline_values",
            multiline,
            "it says whether a quoted CSV value may span lines",
            "use true or false (default false: one line, one record)",
        )
    return TableSchema(
        columns=tuple(_column(str(n), raw) for n, raw in columns.items()),
        reviewed=reviewed,
        missing_values=tuple(missing),
        dp=dict(data.get("dp", {})),
        csv_multiline_values=multiline,
    )


def load_schema(path: str | Path) -> TableSchema:
    """Read and validate a schema TOML file."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "schema", str(p), f"the file cannot be read ({exc.__class__.__name__})", "check the path"
        ) from None
    try:
        toml: Any = importlib.import_module("tomllib")
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        toml = importlib.import_module("tomli")
    try:
        data = toml.loads(text)
    except ValueError as exc:
        from veil.toml_syntax import where

        raise ConfigError(
            "schema", str(p), f"it is not valid TOML ({where(text, exc)})", "fix the syntax"
        ) from None
    return parse_schema(data, str(p))


# -- writing ------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"non-finite number {v} in a schema")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _column_lines(c: ColumnSpec) -> list[str]:
    if c.role == "target":
        return ['role = "target"', f"classes = {_toml_value(c.levels)}"]
    lines = [f"type = {_toml_value(c.type)}"]
    if c.type == "numeric":
        assert c.bounds is not None
        lines += [f"bounds = {_toml_value(list(c.bounds))}", f"outside = {_toml_value(c.outside)}"]
    if c.type in ("categorical", "ordinal"):
        lines.append(f"levels = {_toml_value(c.levels)}")
        if c.type == "categorical":
            lines.append(f"encoding = {_toml_value(c.encoding)}")
    if c.type in ("categorical", "ordinal", "boolean"):
        lines.append(f"unknown = {_toml_value(c.unknown)}")
    if c.type in ("numeric", "categorical", "ordinal", "boolean"):
        lines.append(f"missing = {_toml_value(c.missing)}")
    return lines


def schema_to_toml(
    schema: TableSchema, header: Sequence[str] = (), notes: Mapping[str, str] | None = None
) -> str:
    """The schema as TOML text; ``header`` lines and per-column ``notes`` become comments."""
    out = [f"# {line}" if line else "#" for line in header]
    out.append(f"reviewed = {_toml_value(schema.reviewed)}")
    out.append(f"missing_values = {_toml_value(schema.missing_values)}")
    if schema.csv_multiline_values:
        out.append("csv_multiline_values = true")
    if schema.dp:
        out += ["", "[dp]"]
        out += [f"{k} = {_toml_value(v)}" for k, v in schema.dp.items()]
    for c in schema.columns:
        out.append("")
        if notes and c.name in notes:
            out.append(f"# {notes[c.name]}")
        out.append(f"[columns.{json.dumps(c.name, ensure_ascii=False)}]")
        out += _column_lines(c)
    return "\n".join(out) + "\n"


def write_schema(
    schema: TableSchema, path: str | Path, header: Sequence[str] = (), notes: Mapping[str, str] | None = None
) -> None:
    """Write the schema atomically (a reader never sees half a file)."""
    from veil.accounting.ledger import atomic_write_text

    text = schema_to_toml(schema, header, notes)
    parse_schema(_loads(text))  # what is written must read back
    atomic_write_text(Path(path), text)


def _loads(text: str) -> dict[str, Any]:
    try:
        toml: Any = importlib.import_module("tomllib")
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        toml = importlib.import_module("tomli")
    return dict(toml.loads(text))
