"""The settings of a ``veil pate`` run: :class:`PateConfig`, defaults < TOML file < flags.

Every field has one :data:`RULES` entry: what a valid value is, why it matters, and the fix. Any bad
value (wrong type or out of range) and any unknown key is refused with a
:class:`~veil.errors.ConfigError` in veil's one message format, naming the setting, before any
work starts.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from veil.accounting.defaults import DEFAULT_DELTA
from veil.config import legacy_secure_rng
from veil.errors import ConfigError, VeilError

__all__ = ["RULES", "PateConfig", "make_pate_config", "resolve_pate_config"]

_AGGREGATORS = ("lnmax", "gnmax", "confident-gnmax")
_BUDGETS = ("data-independent", "data-dependent", "ptr")


class PateConfig(BaseModel):
    """Every setting of a ``veil pate`` run, with its default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- data ------------------------------------------------------------------------------------
    dataset: str = "digits"
    data_dir: str | None = None
    dataset_id: str | None = None
    """The declared identity the run is charged to (``--dataset-id``; default: the data's fingerprint)."""
    target: str | None = None
    public_data: str | None = None
    """An ``.npz`` (array ``x``, optional ``y``) or ``.npy`` file of public examples."""
    holdout_fraction: float = 0.4
    """Share held out from the private data (datasets without a fixed test split)."""
    public_fraction: float = 0.5
    """Share of the held-out examples that form the public pool (the rest: test)."""
    # -- teachers and student -------------------------------------------------------------------
    teachers: int = 50
    teacher_model: str = "sklearn-logreg"
    student_model: str = "sklearn-logreg"
    epochs: int = 20
    """Epochs of the torch models (teachers and student)."""
    workers: int = 1
    # -- privacy --------------------------------------------------------------------------------
    aggregator: Literal["lnmax", "gnmax", "confident-gnmax"] = "gnmax"
    epsilon: float = 2.0
    delta: float = DEFAULT_DELTA
    queries: int | None = None
    """Largest number of queries asked (default: the whole public pool)."""
    sigma: float | None = None
    """GNMax σ / Confident-GNMax σ₂ (default 0.16·K) or LNMax scale b (default 0.08·K), in votes."""
    threshold: float | None = None
    """Confident-GNMax threshold T (default 0.8·K)."""
    sigma1: float | None = None
    """Confident-GNMax threshold noise σ₁ (default 0.6·K)."""
    budget: Literal["data-independent", "data-dependent", "ptr"] = "data-independent"
    """Which ε stops the run; ``ptr``: Propose-Test-Release makes the data-dependent bound a guarantee."""
    accountant: Literal["pld", "rdp"] = "pld"
    """Accountant of LNMax; the Gaussian aggregators are accounted in RDP."""
    data_dependent: bool = True
    """Compute and privately release the data-dependent ε (GNMax, Confident-GNMax)."""
    order: float | None = None
    smooth_beta: float | None = None
    smooth_sigma: float | None = None
    dd_confidence: float = 0.95
    dd_check_every: int = 50
    ptr_test_share: float = 0.1
    ptr_select_share: float = 0.3
    ptr_order: float | None = None
    ptr_max_answers: int | None = None
    classes: list[str] | None = None
    """The public label set, in class-index order (``--classes a,b,c``); required for the user's own
    data (veil never reads the label set off private rows)."""
    semi_supervised: bool = True
    """Self-train the student on the unlabelled public pool (post-processing: no privacy cost)."""
    # -- run --------------------------------------------------------------------------------------
    seed: int = 0
    """Seeds the data-independent choices only (split, partition, query order, models); with
    ``reproducible`` also the vote and release noise."""
    reproducible: bool = False
    """Research mode: the aggregator, threshold, release and PTR noise from generators seeded by ``seed``
    (replayable, so **not** private against anyone who knows the seed; never release-ready). By default
    (false) every private draw comes from the OS CSPRNG (veil.pipeline.randomness)."""
    out: str | None = None
    progress: bool = False

    @property
    def secure_rng(self) -> bool:
        """Noise from the OS CSPRNG: ``not reproducible`` (the name older code reads)."""
        return not self.reproducible

    @model_validator(mode="after")
    def _check_rules(self) -> PateConfig:
        for name, rule in RULES.items():
            value = getattr(self, name)
            if value is not None and not rule.ok(value):
                raise rule.error(name, value)
        return self


@dataclass(frozen=True)
class Rule:
    """What a valid value of one setting is (``ok``; None is always the default), why, and the fix."""

    ok: Callable[[Any], bool]
    why: str
    fix: str

    def error(self, name: str, value: Any, detail: str = "") -> ConfigError:
        return ConfigError(name, value, self.why + (f" ({detail})" if detail else ""), self.fix)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _open_unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and 0 < v < 1


def _order(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 1


def _anything(v: Any) -> bool:
    return True


_TEXT = Rule(_anything, "this setting is a text value", "pass a string")
_SWITCH = Rule(_anything, "this setting is on or off", "pass true or false")
_SHARE = Rule(_open_unit, "a share of the data must leave both parts non-empty", "pass a number in (0, 1)")
_ORDER = Rule(_order, "Rényi orders are > 1 and finite", "pass λ > 1, or leave it unset for the default")
_PTR_SHARE = Rule(
    _open_unit,
    "PTR splits the target ε into shares, each strictly between 0 and 1",
    "pass a number in (0, 1)",
)

RULES: dict[str, Rule] = {
    "dataset": Rule(
        _anything,
        "the dataset is named by text",
        "pass a dataset name such as digits, breast-cancer or csv:PATH",
    ),
    "data_dir": _TEXT,
    "dataset_id": _TEXT,
    "target": _TEXT,
    "public_data": _TEXT,
    "holdout_fraction": _SHARE,
    "public_fraction": _SHARE,
    "teachers": Rule(_count, "the vote histograms every analysis assumes sum to K teachers", "pass K ≥ 1"),
    "teacher_model": _TEXT,
    "student_model": _TEXT,
    "epochs": Rule(_count, "the models need at least one pass over their data", "pass an integer ≥ 1"),
    "workers": Rule(_count, "teachers are trained by this many processes", "pass an integer ≥ 1"),
    "aggregator": Rule(
        lambda v: v in _AGGREGATORS,
        "only LNMax, GNMax and Confident-GNMax have a privacy analysis here",
        f"use one of {', '.join(_AGGREGATORS)}",
    ),
    "epsilon": Rule(_positive, "the target ε must be finite and > 0", "pass ε > 0"),
    "delta": Rule(_open_unit, "δ is a probability of failure in (0, 1)", "pass δ well below 1/N"),
    "queries": Rule(_count, "the student needs at least one query", "pass an integer ≥ 1"),
    "sigma": Rule(_positive, "the aggregator's noise (in votes) sets the privacy guarantee", "pass σ > 0"),
    "threshold": Rule(
        lambda v: isinstance(v, (int, float)) and math.isfinite(v),
        "Confident-GNMax compares the noisy top vote count with a finite threshold T",
        "pass T in votes (default 0.8·K)",
    ),
    "sigma1": Rule(_positive, "the threshold check's noise σ₁ sets its privacy cost", "pass σ₁ > 0"),
    "budget": Rule(
        lambda v: v in _BUDGETS,
        "the budget says which ε stops the run",
        "use data-independent (a worst-case guarantee), data-dependent, or ptr (Propose-Test-Release)",
    ),
    "accountant": Rule(
        lambda v: v in ("pld", "rdp"), "only these accountants bound LNMax here", "use pld or rdp"
    ),
    "data_dependent": _SWITCH,
    "order": _ORDER,
    "smooth_beta": Rule(_positive, "the smoothness β of the release must be > 0", "pass β > 0"),
    "smooth_sigma": Rule(_positive, "the release noise σ_s sets the release's privacy cost", "pass σ_s > 0"),
    "dd_confidence": Rule(
        lambda v: isinstance(v, (int, float)) and 0.5 <= v < 1,
        "the released bound exceeds the true data-dependent cost with this probability; below ½ it "
        "would understate it more often than not",
        "pass a confidence in [0.5, 1)",
    ),
    "dd_check_every": Rule(_count, "releases happen every so many queries", "pass an integer ≥ 1"),
    "ptr_test_share": _PTR_SHARE,
    "ptr_select_share": _PTR_SHARE,
    "ptr_order": _ORDER,
    "ptr_max_answers": Rule(_count, "PTR answers at most this many selected queries", "pass an integer ≥ 1"),
    "classes": Rule(
        lambda v: isinstance(v, list) and len(v) >= 2 and len(set(v)) == len(v) and "" not in v,
        "the declared label set fixes the outputs and must list at least two distinct, non-empty names",
        "pass e.g. --classes no,yes",
    ),
    "semi_supervised": _SWITCH,
    "seed": Rule(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "the seed fixes the split, the partition and the models; seeds are non-negative integers",
        "pass an integer ≥ 0",
    ),
    "reproducible": _SWITCH,
    "out": Rule(_anything, "the run folder is a path", "pass a folder path"),
    "progress": _SWITCH,
}

_KEYS = tuple(PateConfig.model_fields)
assert set(RULES) == set(_KEYS), "every PateConfig field needs a rule"


def _normalise(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        k = str(key).replace("-", "_")
        if k == "secure_rng":  # the old key, mapped as `veil train` maps it
            legacy_secure_rng(value, out, source)
            continue
        if k == "classes" and isinstance(value, str):  # --classes a,b,c
            value = [c.strip() for c in value.split(",")]
        if k not in _KEYS:
            close = difflib.get_close_matches(k, _KEYS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                key,
                value,
                f"unknown {source} setting; a typo must not silently fall back to a default privacy setting",
                f"{hint}use one of {', '.join(_KEYS)}",
            )
        out[k] = value
    return out


def make_pate_config(values: Mapping[str, Any] | None = None, source: str = "config") -> PateConfig:
    """A validated :class:`PateConfig`; a bad key or value raises :class:`~veil.errors.ConfigError`
    naming the setting, its value, why it matters and the fix."""
    clean = _normalise(values or {}, source)
    try:
        return PateConfig(**clean)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, VeilError):
            raise cause from None
        key = str(err["loc"][0]) if err.get("loc") else "config"
        value = clean.get(key, err.get("input"))
        rule = RULES.get(key)
        if rule is None:  # pragma: no cover - RULES covers every field (asserted above)
            raise ConfigError(key, value, str(err.get("msg")), "see docs/pate.md") from None
        detail = "" if err.get("type") == "literal_error" else str(err.get("msg", "")).lower()
        raise rule.error(key, value, detail) from None


def resolve_pate_config(
    config_file: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PateConfig:
    """Defaults < ``config_file`` (a ``[pate]`` table or top-level keys) < ``overrides`` (None: unset)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        from veil.config import load_config_file

        data = load_config_file(config_file)
        if isinstance(data.get("pate"), dict) and len(data) == 1:
            data = data["pate"]
        merged.update(_normalise(data, "config file"))
    if overrides:
        merged.update(_normalise({k: v for k, v in overrides.items() if v is not None}, "flag"))
    return make_pate_config(merged)
