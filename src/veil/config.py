"""The configuration of ``veil train``: one validated, immutable :class:`TrainConfig`.

Precedence: built-in defaults < a TOML config file < command-line flags (or the dict passed to
:func:`veil.train`). Unknown keys are refused by name with the closest known key suggested: a typo
must never fall back silently to a default privacy setting. Values of the wrong type are refused
with the key, the value and the expected type. Keys may be written ``max_grad_norm`` or
``max-grad-norm``.

Hyperparameters left unset (``None``: ``epochs``, ``batch_size``, ``lr``, ``optimizer``,
``momentum``, ``max_grad_norm``) take the tuned preset of the data kind (:data:`veil.presets.PRESETS`); the
presets were chosen on veil's own benchmarks (``bench/utility.py``), never on the user's data, so
choosing them spends no privacy. The resolved config (presets filled in) is saved with every run as
``config.toml``.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from veil.accounting.defaults import DEFAULT_DELTA
from veil.errors import ConfigError, InvalidParameterError, VeilError

__all__ = [
    "MAX_EPSILON",
    "MIN_EPSILON",
    "PRIVACY_KEYS",
    "TrainConfig",
    "config_to_toml",
    "load_config_file",
    "make_config",
    "resolve_config",
    "snake_keys",
    "write_config",
]

DataKind = Literal["image", "table"]

MAX_EPSILON = 100.0
"""The largest target ε accepted: beyond it a guarantee means nothing and σ leaves the accountants' range."""
MIN_EPSILON = 1e-4
"""The smallest target ε accepted: below it σ passes 10⁴ (digits: 1.3·10⁴ at 1e-4), the noise drowns
every update, and the calibration's search leaves the range where ε is resolved (1e-6 fails there)."""


class TrainConfig(BaseModel):
    """Every setting of a ``veil train`` run, with its default."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # -- data --------------------------------------------------------------------------------
    dataset: str = "digits"
    """``digits`` | ``breast-cancer`` | ``fashion-mnist`` | "
    "``mnist`` | ``csv:PATH`` | ``parquet:PATH`` | ``npz:PATH`` | ``sql:URL`` (with ``table_schema``)."""
    table_schema: str | None = None
    """(``--schema``) A table's reviewed schema (TOML, see docs/tables.md): csv/parquet/sql data is read
    and encoded through it (levels, bounds, missing values; the label set is its target's classes)."""
    table: str | None = None
    """Table name of a ``sql:`` dataset."""
    query: str | None = None
    """SQL query of a ``sql:`` dataset (instead of ``table``)."""
    stream: bool = False
    """(``--stream``) Train on Poisson-sampled rows read from a Parquet file window by window, never
    holding the table in memory (docs/tables.md); needs ``parquet:`` data and ``table_schema``."""
    stream_rows: int | None = None
    """Sampled rows a streamed run holds at once (default 1,000,000; one row group comes on top)."""
    privacy_unit: str | None = None
    """(``--privacy-unit COLUMN``) Protect every row sharing this column's value (a patient, a customer)
    as one unit: units are Poisson-sampled, each contributes at most ``max_rows_per_unit`` rows per
    step, clipped once (docs/privacy-unit.md). The column is an identifier: declared ``type =
    "ignored"`` in the schema, never a feature, never printed. Default: each row is its own unit."""
    max_rows_per_unit: int | None = None
    """K, the rows one unit contributes per step at most (public; default ``clamp(⌊1024/B⌋, 1, 16)``)."""
    data_dir: str | None = None
    """Folder of the IDX files (fashion-mnist, mnist)."""
    target: str | None = None
    """Label column (csv, parquet) or label array (npz, default ``y``)."""
    dataset_id: str | None = None
    """The dataset's declared identity in the budget registry (default: from its content or location;
    see docs/budget.md)."""
    test_fraction: float = 0.2
    """Share of the examples held out for testing (stratified, fixed by ``seed``)."""
    feature_bounds: list[list[float]] | dict[str, list[float]] | None = None
    """Public per-feature ``[low, high]`` bounds for tables: a list (one pair per feature, or one pair for
    all) or a table keyed by column name. Given, features are clipped to them and scaled to [-1, 1] at
    no privacy cost; not given, a DP estimate of the feature centres is bought with part of ε."""
    feature_resolution: float = 1e-3
    """Public scale of the log transform of table features: ``asinh(x/r) - asinh(1/r)``."""
    preprocessing_budget: float = 0.5
    """Share of ε that sizes the DP centring of table features (used only without feature_bounds)."""
    center_clip_norm: float | None = None
    """L2 clip of each transformed row for the DP centring (default 5·√d)."""

    # -- model -------------------------------------------------------------------------------
    model: str = "auto"
    """``auto`` | ``logreg`` | ``mlp`` | ``cnn`` | ``scatternet`` | ``rff`` | ``package.module:factory`` |
    ``hf:DIR`` (a pretrained Hugging Face model folder; needs ``veil[hf]``)."""
    text_column: str | None = None
    """Column of texts (csv, parquet, sql), tokenized by the ``hf:DIR`` model's tokenizer."""
    csv_multiline_values: bool = False
    """A text CSV's quoted value may span lines (declared by the data owner). Default: one physical
    line is one record, so one unbalanced quote makes only its own line malformed; with this set, it
    can merge every later row into one dropped record (:mod:`veil.tables.sources.csv_reader`)."""
    max_length: int = 128
    """Tokens per text (padded or truncated): declared, never read off the data."""
    fine_tune: Literal["head", "lora", "full", "last-k"] = "head"
    """``hf:`` models: frozen encoder + DP head (features computed once), LoRA adapters, or everything.
    With ``init_from``: the classifier only, the last ``last_k`` parameterised layers, or everything."""
    init_from: str | None = None
    """Public pretrained weights to start from (a torch state_dict file, a veil ``model.pt`` or run
    folder): declared public by the user; see veil.models.pretrained."""
    last_k: int = 2
    """Layers trained by ``fine_tune = "last-k"`` (modules with parameters of their own, from the end)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: the forward pass under bfloat16 autocast; weights, per-sample norms, the clipped sum and
    the noise stay float32."""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] | None = None
    """Module names that get LoRA adapters (default: peft's choice for the architecture)."""
    lora_dropout: float = 0.0
    lora_lr: float | None = None
    """``--fine-tune lora``: the adapters' learning rate; the head (and any other trained non-adapter
    weight) keeps ``lr``. Default: ``lr`` for all (preset when unset)."""

    # -- privacy -----------------------------------------------------------------------------
    epsilon: float = 3.0
    """Target ε: the whole run (preprocessing included) is calibrated to it and never exceeds it."""
    delta: float = DEFAULT_DELTA
    """Target δ; must be < 1/N (N = training examples). Default: :mod:`veil.accounting.defaults`."""
    noise_multiplier: float | None = None
    """σ given outright instead of calibrated; training still stops before ε would pass the target."""
    max_grad_norm: float | None = None
    """Per-example clip norm C (preset when unset)."""
    batch_size: int | None = None
    """Expected logical batch size B; Poisson sampling rate q = B/N (preset when unset)."""
    epochs: int | None = None
    """Planned epochs; ⌈N/B⌉ noisy steps each (preset when unset)."""
    accountant: Literal["pld", "rdp"] = "pld"
    reproducible: bool = False
    """Research mode: noise and Poisson sampling from generators seeded by ``seed`` (replayable, so
    **not** private against anyone who knows the seed; the report is then not release-ready). By
    default (false) they come from the OS CSPRNG and a resume draws fresh noise."""
    seed: int = 0
    """Seeds the data-independent choices only: the split key, the initialisation, random features
    (and, with ``reproducible``, the noise and sampling)."""
    classes: list[str] | None = None
    """The public label set, in class-index order (``--classes a,b,c``). Built-in datasets declare
    theirs; the user's own data must declare it: veil never reads the label set off private rows."""

    # -- optimisation (no privacy impact) ----------------------------------------------------
    lr: float | None = None
    optimizer: Literal["sgd", "adam"] | None = None
    momentum: float | None = None
    ema_decay: float | None = None
    """Release an exponential moving average of the DP iterates with this decay (0: the last iterate).
    Post-processing: costs no privacy."""
    clip: Literal["fixed", "adaptive"] = "fixed"
    """``adaptive``: the clip norm follows ``target_quantile`` of the per-example gradient norms (Andrew
    et al. 2021); the noisy count is paid inside each step's event (see veil.clipping.adaptive)."""
    target_quantile: float = 0.5
    """The share of examples the adaptive clip norm aims to leave unclipped, in (0, 1)."""
    augment: int = 1
    """Augmentation multiplicity K (images, end-to-end models): each example's gradient is the average
    over K random shifts (and flips, with ``augment_flip``) of it, clipped once (De et al. 2022); the
    sensitivity, so the privacy cost, is unchanged, the compute is K times."""
    augment_flip: bool = False
    """Also mirror the augmented copies left-right (off by default: digits and letters are not symmetric)."""
    physical_batch_size: int | None = None
    """Memory-only: split each logical batch into chunks of at most this many examples."""
    device: str = "cpu"

    # -- run ---------------------------------------------------------------------------------
    baseline: bool = True
    """Also train the same model non-privately to report the utility cost of privacy."""
    out: str | None = None
    """Run folder (default ``runs/<dataset>-<timestamp>``)."""
    checkpoint_every: int = 25
    """Checkpoint every this many steps (and at the end)."""
    audit: bool = False
    """Add the one-run canary audit (white-box gradient canaries) and report its ε lower bound."""
    audit_canaries: int | None = None
    """Number of canaries for ``audit`` (default: chosen from the model size)."""
    audit_confidence: float = 0.95
    """Confidence of the audit's ε lower bound."""
    progress: bool | None = None
    """Show a progress bar (default: only when stdout is a terminal)."""

    @property
    def secure_rng(self) -> bool:
        """Noise and sampling from the OS CSPRNG: ``not reproducible`` (the name older code reads)."""
        return not self.reproducible

    @field_validator("classes")
    @classmethod
    def _classes(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        names = [str(c).strip() for c in v]
        if len(names) < 2 or len(set(names)) != len(names) or "" in names:
            raise ConfigError(
                "classes",
                v,
                "the declared label set fixes the model's outputs and must list at least two distinct, "
                "non-empty class names",
                "pass e.g. --classes no,yes",
            )
        return names

    @field_validator("epsilon")
    @classmethod
    def _epsilon(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise InvalidParameterError(
                "epsilon",
                v,
                "ε bounds the privacy loss and must be a finite number > 0",
                "pass e.g. --epsilon 3",
            )
        if v < MIN_EPSILON:
            raise InvalidParameterError(
                "epsilon",
                v,
                f"an ε below {MIN_EPSILON:g} calibrates the noise above 10⁴ times the clip norm per step, "
                "which drowns every update, and leaves the range where the accountants resolve ε",
                f"pass --epsilon ≥ {MIN_EPSILON:g}",
            )
        if v > MAX_EPSILON:
            raise InvalidParameterError(
                "epsilon",
                v,
                f"an ε above {MAX_EPSILON:g} promises nothing (a factor e^{MAX_EPSILON:g} ≈ "
                f"{math.exp(MAX_EPSILON):.1e} between neighbouring outcomes), and the noise it calibrates to "
                "is below what the accountants resolve",
                f"pass --epsilon ≤ {MAX_EPSILON:g}, or measure a non-private reference with "
                "`veil audit --noise-multiplier 0`",
            )
        return float(v)

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float) -> float:
        if not (0 < v < 1):
            raise InvalidParameterError(
                "delta",
                v,
                "δ is the probability the ε guarantee fails and must lie in (0, 1)",
                "pass δ < 1/N, e.g. 1e-5",
            )
        return float(v)

    @field_validator(
        "noise_multiplier",
        "max_grad_norm",
        "lr",
        "lora_lr",
        "feature_resolution",
        "center_clip_norm",
        "lora_alpha",
    )
    @classmethod
    def _positive(cls, v: float | None, info: Any) -> float | None:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise InvalidParameterError(
                info.field_name, v, "it must be a finite number > 0", "pass a positive number"
            )
        return None if v is None else float(v)

    @field_validator(
        "epochs",
        "batch_size",
        "physical_batch_size",
        "checkpoint_every",
        "lora_rank",
        "max_length",
        "last_k",
        "stream_rows",
        "augment",
        "max_rows_per_unit",
    )
    @classmethod
    def _positive_int(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v < 1:
            raise InvalidParameterError(
                info.field_name, v, "it counts something and must be ≥ 1", "pass an integer ≥ 1"
            )
        return v

    @field_validator("lora_lr")
    @classmethod
    def _lora_lr(cls, v: float | None, info: Any) -> float | None:
        if v is not None and (
            info.data.get("fine_tune") != "lora" or not str(info.data.get("model")).startswith("hf:")
        ):
            raise ConfigError(
                "lora_lr",
                v,
                "it is the learning rate of LoRA adapters, which only --model hf:DIR --fine-tune lora trains",
                "drop --lora-lr, or pass --fine-tune lora with an hf: model",
            )
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if v < 0:
            raise InvalidParameterError(
                "seed", v, "a seed must be a non-negative integer", "pass e.g. --seed 0"
            )
        return v

    @field_validator("test_fraction", "preprocessing_budget", "target_quantile")
    @classmethod
    def _fraction(cls, v: float, info: Any) -> float:
        if not (0 < v < 1):
            raise InvalidParameterError(
                info.field_name, v, "it is a share and must lie in (0, 1)", "pass e.g. 0.2"
            )
        return float(v)

    @field_validator("momentum", "ema_decay", "lora_dropout")
    @classmethod
    def _unit(cls, v: float | None, info: Any) -> float | None:
        if v is not None and not (0 <= v < 1):
            raise InvalidParameterError(info.field_name, v, "it must lie in [0, 1)", "pass e.g. 0.9")
        return None if v is None else float(v)

    @field_validator("feature_bounds")
    @classmethod
    def _bounds(
        cls, v: list[list[float]] | dict[str, list[float]] | None
    ) -> list[list[float]] | dict[str, list[float]] | None:
        if v is None:
            return v
        pairs = v.items() if isinstance(v, dict) else enumerate(v)
        for key, pair in pairs:
            if len(pair) != 2 or not all(math.isfinite(b) for b in pair) or not pair[0] < pair[1]:
                raise ConfigError(
                    f"feature_bounds[{key!r}]",
                    pair,
                    "each bound is a public [low, high] pair with "
                    "low < high; anything else cannot bound a feature",
                    "write [low, high], e.g. [0.0, 100.0]",
                )
        return v


# Settings whose change alters the privacy guarantee or its accounting: a resumed run must keep them.
PRIVACY_KEYS = frozenset(
    {
        "clip",
        "target_quantile",
        "dataset",
        "table_schema",
        "table",
        "query",
        "data_dir",
        "dataset_id",
        "target",
        "test_fraction",
        "feature_bounds",
        "feature_resolution",
        "preprocessing_budget",
        "center_clip_norm",
        "model",
        "text_column",
        "csv_multiline_values",
        "max_length",
        "fine_tune",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
        "lora_dropout",
        "init_from",
        "last_k",
        "epsilon",
        "delta",
        "noise_multiplier",
        "max_grad_norm",
        "batch_size",
        "epochs",
        "accountant",
        "reproducible",
        "seed",
        "classes",
    }
)

_TYPE_NAMES = {
    "float_type": "a number",
    "float_parsing": "a number",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a table",
    "literal_error": "one of the listed values",
    "finite_number": "a finite number",
}


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def snake_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with dashes in the keys as underscores (``batch-size`` → ``batch_size``)."""
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def legacy_secure_rng(value: Any, out: dict[str, Any], source: str) -> None:
    """The old ``secure_rng`` key: true is the default now (nothing to do), false asks for research mode."""
    if not isinstance(value, bool):
        raise ConfigError(
            "secure_rng",
            value,
            f"expected true or false, got {_type_name(value)}; a mistyped setting is refused, not guessed",
            "write reproducible = true for a seeded research run, or drop the key (secure is the default)",
        )
    if value is True and out.get("reproducible") is True:
        raise ConfigError(
            "secure_rng",
            value,
            "secure_rng = true forbids the seeded noise that reproducible = true asks for",
            "keep one of them: reproducible = true (research) or neither (secure, the default)",
        )
    out["reproducible"] = not value


def _normalise_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    known = list(TrainConfig.model_fields)
    out: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key == "secure_rng":
            legacy_secure_rng(value, out, source)
            continue
        if key == "classes" and isinstance(value, str):  # --classes a,b,c
            value = [c.strip() for c in value.split(",")]
        if key not in TrainConfig.model_fields:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(
                f"{source} key",
                raw_key,
                "unknown settings are refused so that a typo cannot "
                "silently leave a privacy setting at its default",
                f"remove or rename it ({hint})",
            )
        out[key] = value
    return out


def make_config(values: Mapping[str, Any] | None = None, source: str = "config") -> TrainConfig:
    """A :class:`TrainConfig` from ``values``; unknown keys and wrong types raise :class:`ConfigError`."""
    clean = _normalise_keys(values or {}, source)
    try:
        return TrainConfig(**clean)
    except ValidationError as exc:
        err = exc.errors()[0]
        original = (err.get("ctx") or {}).get("error")
        if isinstance(original, VeilError):
            raise original from None
        loc = err.get("loc") or ("?",)
        key = str(loc[0])
        value = clean.get(key, err.get("input"))
        expected = _TYPE_NAMES.get(err["type"], err.get("msg", "a valid value"))
        if err["type"] == "literal_error":
            expected = err.get("msg", expected).replace("Input should be ", "")
        raise ConfigError(
            key,
            value,
            f"expected {expected}, got {_type_name(value)}; a "
            "mistyped setting is refused rather than guessed",
            f"set {key} to {expected}",
        ) from None


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value pairs of a TOML config file (keys not yet checked)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", str(p), "the config file does not exist", "pass the path of a TOML file")
    import importlib

    try:
        toml: Any = importlib.import_module("tomllib")  # Python ≥ 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            toml = importlib.import_module("tomli")
        except ModuleNotFoundError:
            raise ConfigError(
                "config", str(p), "reading TOML on Python 3.10 needs the tomli package", "pip install tomli"
            ) from None
    try:
        text = p.read_text(encoding="utf-8")
        data = toml.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("config", str(p), f"not a readable TOML file ({exc})", "check the path") from None
    except toml.TOMLDecodeError as exc:
        from veil.toml_syntax import where

        raise ConfigError(
            "config", str(p), f"not a readable TOML file ({where(text, exc)})", "fix the TOML syntax"
        ) from None
    if isinstance(data.get("train"), dict) and len(data) == 1:
        data = data["train"]  # a single [train] table is accepted too
    return data


def resolve_config(
    config_file: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> TrainConfig:
    """Defaults < ``config_file`` < ``overrides`` (``None`` values in overrides mean "not given")."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(_normalise_keys(load_config_file(config_file), "config file"))
    if overrides:
        merged.update(_normalise_keys({k: v for k, v in overrides.items() if v is not None}, "flag"))
    return make_config(merged)


# -- writing TOML -------------------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError("value", value, "TOML config values must be finite", "use a finite number")
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(
        "value", value, "only scalars and lists are written to config.toml", "report this as a bug"
    )


def config_to_toml(config: TrainConfig) -> str:
    """``config`` as TOML; unset (``None``) values are omitted, so they read back as unset."""
    lines = ["# veil train: the resolved configuration of this run (defaults < config file < flags)."]
    tables: list[str] = []
    for key, value in config.model_dump().items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append(f"\n[{key}]")
            tables.extend(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items())
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines + tables) + "\n"


def write_config(config: TrainConfig, path: str | os.PathLike[str]) -> None:
    """Write ``config`` as TOML atomically (temp file + rename)."""
    from veil.accounting.ledger import atomic_write_text

    atomic_write_text(Path(path), config_to_toml(config))
