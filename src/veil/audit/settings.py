"""What an audit is asked to do (:class:`AuditSettings`), what it returns (:class:`AuditReport`), and
the resolution of its configuration (veil train's precedence: defaults < file < flags)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from veil.audit.bounds import check_confidence
from veil.audit.coordinates import Direction
from veil.errors import ConfigError, InvalidParameterError
from veil.pipeline.outputs import finite

if TYPE_CHECKING:
    from veil.config import TrainConfig

__all__ = ["AuditReport", "AuditSettings", "resolve_audit_config", "settings_from"]

Attack = Literal["canary", "loss", "lira", "all"]
CanaryKind = Literal["gradient", "input", "both"]
LiraChoice = Literal["auto", "online", "offline"]
ATTACKS = ("canary", "loss", "lira", "all")
CANARY_KINDS = ("gradient", "input", "both")
DEFAULT_INPUT_CANARIES = 500


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidParameterError(
            name, value, "not one of the known choices", f"use one of {', '.join(allowed)}"
        )


@dataclass(frozen=True)
class AuditSettings:
    """What to audit and how; checked when built (bad values raise :class:`~veil.errors.VeilError`)."""

    attack: Attack = "canary"
    canaries: int | None = None
    """Canaries per kind. Default: gradient canaries on the model's quiet coordinates (50 to 1000, see
    :func:`~veil.audit.coordinates.auto_canary_count`); 500 input canaries, capped by the held-out data.
    An explicit count above the model's or the data's limit is refused."""
    canary_kind: CanaryKind = "gradient"
    canary_direction: Direction = "dirac"
    confidence: float = 0.95
    shadow_models: int = 8
    lira_variant: LiraChoice = "auto"
    non_private: bool = False
    """Train with σ = 0 (a reference run that promises nothing)."""

    def __post_init__(self) -> None:
        _choice("attack", self.attack, ATTACKS)
        _choice("canary_kind", self.canary_kind, CANARY_KINDS)
        _choice("canary_direction", self.canary_direction, ("dirac", "random"))
        _choice("lira_variant", self.lira_variant, ("auto", "online", "offline"))
        check_confidence(self.confidence)
        c = self.canaries
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise InvalidParameterError("canaries", c, "it counts canaries", "pass --canaries ≥ 1")
        s = self.shadow_models
        if isinstance(s, bool) or not isinstance(s, int) or s < 2:
            raise InvalidParameterError(
                "shadow_models",
                s,
                "LiRA needs shadow models that did not train on each example, so at least 2",
                "pass --shadow-models ≥ 2 (16 or more for online LiRA)",
            )

    @property
    def uses_canaries(self) -> bool:
        return self.attack in ("canary", "all")

    @property
    def uses_lira(self) -> bool:
        return self.attack in ("lira", "all")

    @property
    def gradient(self) -> bool:
        return self.uses_canaries and self.canary_kind in ("gradient", "both")

    @property
    def input(self) -> bool:
        return self.uses_canaries and self.canary_kind in ("input", "both")


@dataclass
class AuditReport:
    """The audit's result: ``report.json`` is :meth:`to_dict`."""

    epsilon_lower_bound: float | None
    confidence: float
    epsilon_theoretical: float | None
    delta: float
    canaries: dict[str, Any] | None
    mia: dict[str, Any] | None
    verdict: str
    reading: str
    source: str
    run: dict[str, Any]
    timing: dict[str, float]
    files: dict[str, str] = field(default_factory=dict)
    out_dir: str | None = None
    veil_version: str = ""
    randomness: str = "secure"
    dataset_budget: dict[str, Any] | None = None

    NON_PRIVATE_NOTE: ClassVar[str] = (
        "every figure of an audit (bounds, attack scores, accuracy) is computed from the private data "
        "without privacy: keep this report internal"
    )

    def to_dict(self) -> dict[str, Any]:
        """``report.json`` in the common report schema (:mod:`veil.report.schema`): an audit releases
        nothing under a guarantee, so every measured figure is in ``non_private``."""
        from veil.report.publish import plain_summary
        from veil.report.schema import Guarantee, ReportBuilder

        guarantee = Guarantee(
            epsilon=None,
            delta=self.delta,
            unit="row",
            neighbouring="add_or_remove_one",
            accountant="none: an audit measures, it releases nothing under a guarantee",
            covers="nothing: every figure of an audit is computed from the private data without noise",
            randomness="secure" if self.randomness == "secure" else "seeded",
            release_ready=False,
            statement="An audit attacks a training run to measure how much it leaks (a lower bound on "
            "its ε); it is a check, not a release: keep the whole report internal.",
            evidence=None,
            extra={"promised_epsilon": self.epsilon_theoretical},
        )
        b = ReportBuilder("audit", guarantee)
        b.public_fields(
            {
                "confidence": self.confidence,
                "epsilon_theoretical": self.epsilon_theoretical,
                "delta": self.delta,
                "source": self.source,
                "timing": self.timing,
                "out_dir": self.out_dir,
                "veil_version": self.veil_version,
                "randomness": self.randomness,
                "release_ready": False,
            }
        )
        b.non_private_fields(
            {
                "covers": "the whole report",
                "note": self.NON_PRIVATE_NOTE,
                "test_accuracy": (self.run or {}).get("test_accuracy"),
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "verdict": self.verdict,
                "reading": self.reading,
                "canaries": self.canaries,
                "mia": self.mia,
                "run": self.run,
            }
        )
        for name, what in self.files.items():
            b.file(name, what, non_private=name not in ("report.json", "report.html"))
        b.file("release", "the public part of this report (the guarantee statement: nothing released)")
        b.release_file("report.json").release_file("report.html")
        b.check(
            "measured_within_promise",
            self.verdict != "violation",
            f"verdict: {self.verdict.replace('_', ' ')} (the measured lower bound must not exceed the "
            "accountant's ε)",
        )
        b.dataset_budget = self.dataset_budget
        b.summary = plain_summary(guarantee.to_dict(), self.dataset_budget, "this audit")
        return b.build()

    def to_json(self) -> str:
        return json.dumps(finite(self.to_dict()), indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Config resolution (veil train's precedence, plus the non-private reference run)
# ---------------------------------------------------------------------------------------------
def resolve_audit_config(
    config_file: str | Path | None, flags: Mapping[str, Any]
) -> tuple[TrainConfig, dict[str, Any], bool]:
    """(training config, audit values from the file's ``[audit]`` table, non-private?) with
    defaults < file < flags. ``epsilon = inf`` or ``noise_multiplier = 0`` mean a σ = 0 run."""
    from veil.config import load_config_file, make_config, snake_keys

    merged: dict[str, Any] = {}
    audit_values: dict[str, Any] = {}
    if config_file is not None:
        raw = dict(load_config_file(config_file))
        table = raw.pop("audit", None)
        if table is not None and not isinstance(table, dict):
            raise ConfigError(
                "audit", table, "the [audit] section must be a table", "write [audit] then keys"
            )
        if isinstance(raw.get("train"), dict) and len(raw) == 1:
            raw = raw["train"]
        merged.update(snake_keys(raw))
        audit_values = snake_keys(table or {})
    merged.update({k: v for k, v in flags.items() if v is not None})
    eps, sigma = merged.get("epsilon"), merged.get("noise_multiplier")
    eps_inf = isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isinf(eps) and eps > 0
    sigma_zero = isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and sigma == 0
    if eps_inf and sigma is not None and not sigma_zero:
        raise ConfigError(
            "noise_multiplier",
            sigma,
            "epsilon = inf asks for a non-private (σ = 0) run, which contradicts a noise multiplier",
            "drop --noise-multiplier, or give a finite --epsilon",
        )
    if sigma_zero and eps is not None and not eps_inf:
        raise ConfigError(
            "epsilon",
            eps,
            "noise_multiplier = 0 trains without noise, so no finite target ε can be met",
            "drop --epsilon (or pass --epsilon inf) for a non-private reference run",
        )
    if eps_inf:
        merged.pop("epsilon")
    if sigma_zero:
        merged.pop("noise_multiplier")
    return make_config(merged), audit_values, eps_inf or sigma_zero


def settings_from(values: Mapping[str, Any], **overrides: Any) -> AuditSettings:
    """:class:`AuditSettings` from a file's ``[audit]`` table and flags (unknown keys refused)."""
    known = set(AuditSettings.__dataclass_fields__)
    merged = {**values, **{k: v for k, v in overrides.items() if v is not None}}
    for key in merged:
        if key not in known:
            raise ConfigError(
                "audit key",
                key,
                "unknown settings are refused so that a typo cannot silently weaken the audit",
                f"use one of {', '.join(sorted(known))}",
            )
    return AuditSettings(**merged)
