"""``veil audit`` as functions: train with canaries and attack the model, or attack a finished run.

:func:`audit` runs veil's training pipeline (the same data loading, split, presets, preprocessing,
model zoo and :class:`~veil.PrivacyEngine` as ``veil train``, σ calibrated to the target or given,
or σ = 0 for a non-private reference run) with canaries, then

* ``canary``: scores the canaries and reports the one-run ε lower bound at the stated confidence
  (:mod:`veil.audit.bounds`), together with the loss-threshold attack (free: no retraining);
* ``loss``: the loss-threshold attack only (a plain run, no canaries);
* ``lira``: LiRA with shadow models trained by the same pipeline on random halves of the pool
  (training split + clean held-out examples), plus the loss attack;
* ``all``: everything.

:func:`audit_run` attacks the ``model.pt`` of a finished ``veil train`` run (loss attack, and LiRA
with shadows if asked), re-creating the run's split from its ``config.toml`` and checking the data
fingerprint against its ``report.json``.

What differs from ``veil train`` in an audit run (and why). Input canaries make the dataset N + m
records, an excluded canary staying as a zero-weight record, so the sampling rate q = B/(N + m) does
not depend on the canary bits; the loss is therefore the weighted sum of per-example losses
(``loss_reduction="sum"``; the per-example clipped gradients are the same as with a mean). No ledger,
checkpoints or budget stop: the accountant's ε for the steps actually taken is the promise the audit
is compared with (``epsilon_theoretical``; null for σ = 0). Shadow models reuse the target's σ.

For ``veil train --audit``, :func:`run_one_run_audit` attaches gradient canaries to an engine built
elsewhere and returns an object whose ``finish()`` gives the report section.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from veil.audit.bounds import OneRunBound, check_confidence
from veil.audit.canaries import (
    Direction,
    GradientCanaries,
    InputCanaries,
    max_gradient_canaries,
    max_input_canaries,
)
from veil.audit.report import reading, verdict
from veil.errors import (
    ConfigError,
    DataError,
    InvalidParameterError,
    ModelNotSupportedError,
    SamplingError,
    UnreachableTargetError,
)

if TYPE_CHECKING:
    from torch import nn

    from veil.accounting.events import PrivacyEvent
    from veil.audit.mia import MIAResult
    from veil.config import TrainConfig
    from veil.data import Dataset
    from veil.data.preprocess import PreprocessingPlan
    from veil.engine import PrivacyEngine
    from veil.mechanisms.rng import RandomSource
    from veil.optimizer import DPOptimizer

__all__ = [
    "AuditReport",
    "AuditSettings",
    "OneRunAudit",
    "audit",
    "audit_run",
    "run_one_run_audit",
]

Attack = Literal["canary", "loss", "lira", "all"]
CanaryKind = Literal["gradient", "input", "both"]
LiraChoice = Literal["auto", "online", "offline"]
ATTACKS = ("canary", "loss", "lira", "all")
CANARY_KINDS = ("gradient", "input", "both")
DEFAULT_INPUT_CANARIES = 500
RUN_FILES = ("report.json", "config.toml", "model.pt")


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
    :func:`~veil.audit.canaries.auto_canary_count`); 500 input canaries, capped by the held-out data.
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "confidence": self.confidence,
            "epsilon_theoretical": self.epsilon_theoretical,
            "delta": self.delta,
            "verdict": self.verdict,
            "reading": self.reading,
            "canaries": self.canaries,
            "mia": self.mia,
            "source": self.source,
            "run": self.run,
            "timing": self.timing,
            "files": self.files,
            "out_dir": self.out_dir,
            "veil_version": self.veil_version,
        }

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=2, allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.generic):
        return _finite(value.item())
    return value


# ---------------------------------------------------------------------------------------------
# The training pipeline (veil train's building blocks, without ledger and budget stop)
# ---------------------------------------------------------------------------------------------
def _child_seed(seed: int, purpose: int) -> int:
    return int(np.random.SeedSequence([seed, purpose]).generate_state(1)[0])


@dataclass
class _Setup:
    cfg: TrainConfig
    data: Dataset
    prep: PreprocessingPlan
    pre_events: list[PrivacyEvent]
    private: bool
    model_name: str
    preprocess_state: dict[str, Any] | None = None
    """The released preprocessing statistic of a finished run (``--run``): shadows reuse it."""


@dataclass
class _Fit:
    model: nn.Module
    engine: PrivacyEngine
    optimizer: DPOptimizer
    steps: int
    seconds: float


def _prepare(cfg: TrainConfig, private: bool, *, run_preprocessing: bool = True) -> _Setup:
    from veil.config import apply_presets, preset_for
    from veil.data import load_dataset
    from veil.data.preprocess import plan_preprocessing
    from veil.data.preprocess import run_preprocessing as release
    from veil.mechanisms.rng import make_source
    from veil.models import resolve_name

    data = load_dataset(
        cfg.dataset, data_dir=cfg.data_dir, target=cfg.target, test_fraction=cfg.test_fraction, seed=cfg.seed
    )
    n = data.n_train
    if private and cfg.delta >= 1.0 / n:
        raise InvalidParameterError(
            "delta",
            cfg.delta,
            f"δ ≥ 1/N (N = {n} training examples) allows a mechanism that publishes a whole record outright",
            f"pass a δ well below 1/N, e.g. --delta {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
        )
    cfg = apply_presets(cfg, preset_for(cfg.model, data), n)
    assert cfg.batch_size is not None
    if cfg.batch_size > n:
        raise SamplingError(
            "batch_size",
            cfg.batch_size,
            f"the sampling rate q = batch_size / N must be ≤ 1 and there are N = {n} training examples",
            f"pass --batch-size of at most {n}",
        )
    prep = plan_preprocessing(cfg, data)
    pre: list[PrivacyEvent] = []
    if prep.event is not None and run_preprocessing:
        rng = make_source(cfg.secure_rng, None if cfg.secure_rng else _child_seed(cfg.seed, 1))
        release(prep, data, rng)
        pre.append(prep.event)
    name = resolve_name(cfg.model, data.kind, data.input_shape)
    return _Setup(cfg, data, prep, pre, private, name)


def _make_model(setup: _Setup, seed: int) -> nn.Module:
    import torch
    from torch import nn

    from veil.data.preprocess import build_transform
    from veil.models import build_model
    from veil.validation import fix, validate

    cfg, data = setup.cfg, setup.data
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_model(cfg.model, data.input_shape, data.num_classes, data.kind)
    if validate(net):
        net = fix(net)
        problems = validate(net)
        if problems:
            raise ModelNotSupportedError(problems)
    model = nn.Sequential(OrderedDict(preprocess=build_transform(setup.prep, data.input_shape), net=net))
    if setup.preprocess_state is not None:
        model.get_submodule("preprocess").load_state_dict(setup.preprocess_state, strict=False)
    return model.to(cfg.device)


def _event_epsilon(accountant: str, events: list[PrivacyEvent], delta: float) -> float:
    from veil.accounting.base import make_accountant

    acc = make_accountant(accountant)  # type: ignore[arg-type]
    for e in events:
        acc.compose(e)
    return float(acc.epsilon(delta))


def _sigma(setup: _Setup, n_records: int) -> float:
    """σ: 0 (non-private), the given one, or calibrated so the planned run fits the target ε."""
    from veil.accounting.calibrate import calibrate_noise, dpsgd_event
    from veil.accounting.events import SelfComposed
    from veil.sampling import steps_per_epoch

    cfg = setup.cfg
    if not setup.private:
        return 0.0
    if cfg.noise_multiplier is not None:
        return float(cfg.noise_multiplier)
    assert cfg.batch_size is not None and cfg.epochs is not None
    q = cfg.batch_size / n_records
    steps = cfg.epochs * steps_per_epoch(n_records, cfg.batch_size)
    sigma0 = float(calibrate_noise(cfg.epsilon, cfg.delta, q, steps, accountant=cfg.accountant))
    if not setup.pre_events:
        return sigma0

    def fits(sigma: float) -> bool:
        events = [*setup.pre_events, SelfComposed(dpsgd_event(q, sigma), steps)]
        return _event_epsilon(cfg.accountant, events, cfg.delta) <= cfg.epsilon

    if _event_epsilon(cfg.accountant, setup.pre_events, cfg.delta) >= cfg.epsilon:
        raise UnreachableTargetError(
            "preprocessing_budget",
            cfg.preprocessing_budget,
            "the DP preprocessing alone spends the whole target ε",
            "lower preprocessing_budget, raise --epsilon, or declare public feature_bounds",
        )
    lo, hi = sigma0, sigma0 * 1.25
    while not fits(hi):
        lo, hi = hi, hi * 2
    while hi / lo > 1.002:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _fit(
    setup: _Setup,
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    *,
    sigma: float,
    seed: int,
    before: Callable[[nn.Module, DPOptimizer, PrivacyEngine, np.ndarray], None] | None = None,
) -> _Fit:
    """DP-SGD on ``(x, y)`` with per-record weights ``w`` (0 = a present but inert record).

    A model with a fixed front (:class:`veil.models.FixedFeaturesThenHead`) is trained as ``veil
    train`` trains it: the front maps every record once (a fixed per-example map, no privacy cost)
    and DP-SGD trains the head on the features. ``before(trained, optimizer, engine, inputs)`` runs
    after ``make_private``, with ``inputs`` the records as ``trained`` takes them. The returned
    model is the whole model (raw inputs in)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from veil.engine import PrivacyEngine, refuse_example_mixing
    from veil.models import fixed_features, split_fixed_front

    cfg = setup.cfg
    assert cfg.batch_size is not None and cfg.epochs is not None and cfg.max_grad_norm is not None
    assert cfg.lr is not None
    device = cfg.device
    model = _make_model(setup, seed)
    t0 = time.perf_counter()  # the fixed features count as training time
    front, trained = split_fixed_front(model)
    if front is not None:  # make_private sees only the head: probe the whole model first
        refuse_example_mixing(model, x, y)
    inputs = x if front is None else fixed_features(front, x, device)
    if cfg.optimizer == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(trained.parameters(), lr=cfg.lr)
    else:
        optimizer = torch.optim.SGD(trained.parameters(), lr=cfg.lr, momentum=cfg.momentum or 0.0)
    engine = PrivacyEngine(
        accountant=cfg.accountant,
        secure_rng=cfg.secure_rng,
        seed=None if cfg.secure_rng else _child_seed(seed, 2),
    )
    dataset = TensorDataset(
        torch.as_tensor(inputs), torch.as_tensor(y, dtype=torch.long), torch.as_tensor(w, dtype=torch.float32)
    )
    loader = DataLoader(dataset, batch_size=min(cfg.batch_size, len(dataset)))
    trained, dp_optimizer, dp_loader = engine.make_private(
        module=trained,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=cfg.max_grad_norm,
        loss_reduction="sum",
        physical_batch_size=cfg.physical_batch_size,
    )
    if before is not None:
        before(trained, dp_optimizer, engine, inputs)
    for _ in range(cfg.epochs):
        for xb, yb, wb in dp_loader:
            dp_optimizer.zero_grad()
            out = trained(xb.to(device))
            loss = (F.cross_entropy(out, yb.to(device), reduction="none") * wb.to(device)).sum()
            loss.backward()
            dp_optimizer.step()
    seconds = time.perf_counter() - t0
    return _Fit(model, engine, dp_optimizer, engine.steps, seconds)


def _theoretical(setup: _Setup, fit: _Fit) -> float | None:
    if not setup.private:
        return None
    assert fit.engine.plan is not None
    events = [*setup.pre_events]
    if fit.steps:
        from veil.accounting.events import SelfComposed

        events.append(SelfComposed(fit.engine.plan.event, fit.steps))
    return _event_epsilon(setup.cfg.accountant, events, setup.cfg.delta) if events else 0.0


# ---------------------------------------------------------------------------------------------
# Config resolution (veil train's precedence, plus the non-private reference run)
# ---------------------------------------------------------------------------------------------
def resolve_audit_config(
    config_file: str | Path | None, flags: Mapping[str, Any]
) -> tuple[TrainConfig, dict[str, Any], bool]:
    """(training config, audit values from the file's ``[audit]`` table, non-private?) with
    defaults < file < flags. ``epsilon = inf`` or ``noise_multiplier = 0`` mean a σ = 0 run."""
    from veil.config import load_config_file, make_config

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
        merged.update({str(k).replace("-", "_"): v for k, v in raw.items()})
        audit_values = {str(k).replace("-", "_"): v for k, v in (table or {}).items()}
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


# ---------------------------------------------------------------------------------------------
# Output folder and report files
# ---------------------------------------------------------------------------------------------
def _delta_cap(delta: float) -> int:
    """The most canaries m with 2·m·δ < 1 (the automatic count stays below it)."""
    return max(1, math.ceil(1 / (2 * delta)) - 1) if delta > 0 else 10**9


def _check_delta_room(canaries: int, delta: float) -> None:
    """The (ε, δ) one-run bound needs 2·m·δ < 1; refuse before training rather than after."""
    if canaries and 2 * canaries * delta >= 1:
        raise InvalidParameterError(
            "canaries",
            canaries,
            f"with δ = {delta:g}, 2·m·δ = {2 * canaries * delta:.3g} ≥ 1 makes the (ε, δ) one-run bound "
            "vacuous",
            f"pass --canaries < {math.ceil(1 / (2 * delta))} or a smaller --delta",
        )


def _check_out(out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise ConfigError("out", str(out), "it exists and is not a folder", "pass a new folder for --out")
        if any(out.iterdir()):
            raise ConfigError(
                "out",
                str(out),
                "the folder is not empty and an earlier audit's results must not be overwritten",
                "pass a new or empty folder for --out",
            )


def _write(report: AuditReport, out: Path, images: Mapping[str, tuple[str, bytes]]) -> None:
    from veil.audit.report import render_html

    files = {"report.json": "this report, machine-readable", "report.html": "this report as a page"}
    files.update({name: title for name, (title, _) in images.items()})
    report.files = files
    report.out_dir = str(out)
    html = render_html(_finite(report.to_dict()), {title: png for title, png in images.values()})
    text = report.to_json()
    out.mkdir(parents=True, exist_ok=True)  # everything is computed before the first file is written
    for name, (_, png) in images.items():
        (out / name).write_bytes(png)
    (out / "report.html").write_text(html, encoding="utf-8")
    (out / "report.json").write_text(text, encoding="utf-8")


def _images(
    attacks: list[MIAResult], groups: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, tuple[str, bytes]]:
    from veil.audit.report import canary_png, roc_png

    images: dict[str, tuple[str, bytes]] = {}
    if groups:
        images["canaries.png"] = ("Canary scores, included against excluded", canary_png(groups))
    if attacks:
        images["roc.png"] = ("Membership inference ROC", roc_png(attacks))
    return images


def _mia_section(attacks: list[MIAResult]) -> dict[str, Any] | None:
    if not attacks:
        return None
    strongest = next((a for a in attacks if a.attack == "lira"), attacks[0])
    section = strongest.to_dict()
    section["attacks"] = {a.attack: a.to_dict() for a in attacks}
    return section


def _version() -> str:
    import veil

    return str(veil.__version__)


# ---------------------------------------------------------------------------------------------
# veil audit: train with canaries, then attack
# ---------------------------------------------------------------------------------------------
def _lira(
    setup: _Setup,
    target: nn.Module,
    members: tuple[np.ndarray, np.ndarray],
    nonmembers: tuple[np.ndarray, np.ndarray],
    settings: AuditSettings,
    sigma: float,
    rng: RandomSource,
) -> tuple[MIAResult, float]:
    from veil.audit.mia import run_lira

    x = np.concatenate([members[0], nonmembers[0]])
    y = np.concatenate([members[1], nonmembers[1]])
    is_member = np.concatenate([np.ones(len(members[1]), bool), np.zeros(len(nonmembers[1]), bool)])
    seconds = 0.0

    def train_shadow(indices: np.ndarray, k: int) -> nn.Module:
        nonlocal seconds
        fit = _fit(
            setup,
            x[indices],
            y[indices],
            np.ones(len(indices), np.float32),
            sigma=sigma,
            seed=_child_seed(setup.cfg.seed, 1000 + k),
        )
        seconds += fit.seconds
        return fit.model

    result = run_lira(
        target,
        (x, y),
        is_member,
        train_shadow,
        shadows=settings.shadow_models,
        rng=rng,
        variant=settings.lira_variant,
        device=setup.cfg.device,
    )
    return result, seconds


def audit(
    config: TrainConfig | Mapping[str, Any] | None = None,
    settings: AuditSettings | None = None,
    *,
    out: str | Path | None = None,
    write: bool = True,
) -> AuditReport:
    """Train with canaries (per ``settings``), attack the model, write ``report.json``/``.html``.

    ``config``: a :class:`~veil.config.TrainConfig` or a dict of its fields (the training run to
    audit; presets fill the rest). Every check (settings, data, canary counts, output folder) runs
    before training. See the module docstring for what is measured.
    """
    from veil.audit.mia import loss_attack
    from veil.config import TrainConfig, make_config
    from veil.mechanisms.rng import make_source

    settings = settings or AuditSettings()
    cfg = config if isinstance(config, TrainConfig) else make_config(config or {})
    setup = _prepare(cfg, private=not settings.non_private)
    cfg, data = setup.cfg, setup.data
    out_dir = Path(out) if out is not None else _default_out(cfg)
    if write:
        _check_out(out_dir)
    rng = make_source(cfg.secure_rng, None if cfg.secure_rng else _child_seed(cfg.seed, 11))

    # -- canaries, checked before any training -------------------------------------------------
    n_in = 0
    if settings.gradient and settings.canaries is not None:  # None: chosen from the model (auto)
        limit = max_gradient_canaries(_make_model(setup, cfg.seed), settings.canary_direction)
        if settings.canaries > limit:
            raise InvalidParameterError(
                "canaries",
                settings.canaries,
                f"the model has room for {limit} gradient canaries "
                f"({'one coordinate each' if settings.canary_direction == 'dirac' else 'within memory'})",
                f"pass --canaries ≤ {limit}",
            )
    if settings.input:
        limit = max_input_canaries(data.n_test)
        n_in = settings.canaries if settings.canaries is not None else min(DEFAULT_INPUT_CANARIES, limit)
        if n_in > limit or n_in < 1:
            raise InvalidParameterError(
                "canaries",
                n_in,
                f"input canaries are held-out examples with a wrong label; there are {data.n_test} held-out "
                "examples and half must stay clean non-members",
                f"pass --canaries ≤ {limit}, or --canary-kind gradient",
            )
    _check_delta_room(max(n_in, (settings.canaries or 0) if settings.gradient else 0), cfg.delta)
    inputs = InputCanaries.design(data.x_test, data.y_test, n_in, data.num_classes, rng=rng) if n_in else None
    clean = np.ones(data.n_test, dtype=bool)
    if inputs is not None:
        clean[inputs.source] = False
    x_out, y_out = data.x_test[clean], data.y_test[clean]
    x = data.x_train
    y = data.y_train
    w = np.ones(data.n_train, np.float32)
    if inputs is not None:
        x = np.concatenate([x, inputs.x.astype(x.dtype)])
        y = np.concatenate([y, inputs.y.astype(y.dtype)])
        w = np.concatenate([w, inputs.weights()])
    sigma = _sigma(setup, len(y))
    grads: list[GradientCanaries] = []

    def attach(model: nn.Module, optimizer: DPOptimizer, engine: PrivacyEngine, inputs: np.ndarray) -> None:
        assert cfg.max_grad_norm is not None and engine.sampling_rate is not None
        canaries = GradientCanaries.design(
            model,
            settings.canaries,
            rng=rng,
            max_grad_norm=cfg.max_grad_norm,
            direction=settings.canary_direction,
            sample=(inputs[: data.n_train], data.y_train),  # the training records come first
            expected_batch_size=optimizer.expected_batch_size,
            noise_multiplier=optimizer.noise_multiplier,
            cap=_delta_cap(cfg.delta),
        )
        canaries.attach(optimizer, sampling_rate=engine.sampling_rate)
        grads.append(canaries)

    t0 = time.perf_counter()
    fit = _fit(setup, x, y, w, sigma=sigma, seed=cfg.seed, before=attach if settings.gradient else None)
    epsilon_theoretical = _theoretical(setup, fit)
    target = fit.model
    members = (data.x_train, data.y_train)

    # -- canary bounds -------------------------------------------------------------------------
    kinds = int(settings.gradient) + int(bool(n_in))  # fixed by the settings, before any score
    canary_section: dict[str, Any] | None = None
    groups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    bounds: list[OneRunBound] = []
    if kinds:
        canary_section = {"count": sum(g.count for g in grads) + n_in}
        if grads:
            g = grads[0]
            g.detach()
            b = g.bound(settings.confidence, delta=cfg.delta, share=kinds)
            bounds.append(b)
            canary_section["gradient"] = {**g.summary(), "bound": b.to_dict()}
            groups["gradient"] = (g.scores(), g.included)
        if inputs is not None:
            inputs.score(target, device=cfg.device)
            b = inputs.bound(settings.confidence, delta=cfg.delta, share=kinds)
            bounds.append(b)
            canary_section["input"] = {**inputs.summary(), "bound": b.to_dict()}
            assert inputs._scores is not None
            groups["input"] = (inputs._scores, inputs.included)
    audit_seconds = time.perf_counter() - t0

    # -- membership inference ------------------------------------------------------------------
    attacks = [loss_attack(target, members, (x_out, y_out), device=cfg.device)]
    lira_seconds = 0.0
    if settings.uses_lira:
        result, lira_seconds = _lira(setup, target, members, (x_out, y_out), settings, sigma, rng)
        attacks.append(result)
    lower = max((b.epsilon for b in bounds), default=None)
    mia = _mia_section(attacks)
    report = AuditReport(
        epsilon_lower_bound=lower,
        confidence=settings.confidence,
        epsilon_theoretical=epsilon_theoretical,
        delta=cfg.delta,
        canaries=canary_section,
        mia=mia,
        verdict=verdict(lower, epsilon_theoretical),
        reading=reading(lower, epsilon_theoretical, settings.confidence, cfg.delta, mia),
        source=f"veil audit: a {'non-private (σ = 0)' if not setup.private else 'DP'} training run of "
        f"'{setup.model_name}' on '{data.name}', trained by veil's pipeline with the canaries inserted",
        run=_run_info(setup, fit, sigma, len(y), target, settings),
        timing={
            "training_s": fit.seconds,
            "one_run_audit_s": audit_seconds,
            "shadow_training_s": lira_seconds,
        },
        veil_version=_version(),
    )
    if write:
        _write(report, out_dir, _images(attacks, groups))
    return report


def _run_info(
    setup: _Setup, fit: _Fit, sigma: float, records: int, model: nn.Module, settings: AuditSettings
) -> dict[str, Any]:
    from veil.audit.mia import model_logits

    cfg, data = setup.cfg, setup.data
    logits = model_logits(model, data.x_test, device=cfg.device)
    accuracy = float((logits.argmax(1) == data.y_test).mean()) if len(logits) else float("nan")
    return {
        "dataset": data.name,
        "dataset_sha256": data.sha256,
        "model": setup.model_name,
        "n_train": data.n_train,
        "records_in_training_set": records,
        "non_private": not setup.private,
        "target_epsilon": cfg.epsilon if setup.private and cfg.noise_multiplier is None else None,
        "noise_multiplier": sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "batch_size": cfg.batch_size,
        "sampling_rate": fit.engine.sampling_rate,
        "epochs": cfg.epochs,
        "steps": fit.steps,
        "lr": cfg.lr,
        "optimizer": cfg.optimizer or "sgd",
        "accountant": cfg.accountant,
        "seed": cfg.seed,
        "secure_rng": cfg.secure_rng,
        "test_accuracy": accuracy,
        "attack": settings.attack,
    }


def _default_out(cfg: TrainConfig) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in Path(cfg.dataset.split(":")[-1]).stem)
    return Path("runs") / f"audit-{safe or 'data'}-{stamp}"


# ---------------------------------------------------------------------------------------------
# veil audit --run DIR: attack a finished veil train run
# ---------------------------------------------------------------------------------------------
def _not_a_run(run: Path, why: str) -> DataError:
    return DataError(
        "run",
        str(run),
        f"this folder is not a finished veil train run ({why}), so the model and its training split "
        "cannot be identified",
        "pass the --out folder of a finished `veil train` run",
    )


def audit_run(
    run_dir: str | Path,
    settings: AuditSettings | None = None,
    *,
    out: str | Path | None = None,
    write: bool = True,
) -> AuditReport:
    """Attack the released ``model.pt`` of a finished ``veil train`` run (no canaries: they must be
    inserted during training). ``settings.attack``: ``loss`` (default), ``lira`` or ``all`` (both;
    LiRA trains shadow models with the run's own settings and σ)."""
    import torch

    from veil.audit.mia import loss_attack
    from veil.config import load_config_file, make_config
    from veil.mechanisms.rng import make_source

    settings = settings or AuditSettings(attack="loss")
    run = Path(run_dir)
    if not run.is_dir():
        raise _not_a_run(run, "no such folder")
    missing = [f for f in RUN_FILES if not (run / f).is_file()]
    if missing:
        raise _not_a_run(run, f"missing {', '.join(missing)}")
    if settings.attack == "canary":
        raise InvalidParameterError(
            "attack",
            settings.attack,
            "canaries must be inserted while training, and this run is finished",
            "use --attack loss or lira with --run, or audit a new run with `veil audit` "
            "(or `veil train --audit`)",
        )
    try:
        saved = json.loads((run / "report.json").read_text(encoding="utf-8"))
        sha = saved["dataset"]["sha256"]
        theoretical = float(saved["epsilon_spent"])
        sigma = float(saved["noise_multiplier"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _not_a_run(run, f"report.json is unreadable: {type(exc).__name__}") from None
    cfg = make_config(load_config_file(run / "config.toml"), source="run config.toml")
    setup = _prepare(cfg, private=True, run_preprocessing=False)
    cfg, data = setup.cfg, setup.data
    if data.sha256 != sha:
        raise DataError(
            "dataset",
            cfg.dataset,
            "the data found now is not the data the run was trained on (sha256 differs), so members and "
            "non-members cannot be told apart",
            "restore the run's dataset",
        )
    out_dir = Path(out) if out is not None else run / "audit"
    if write:
        _check_out(out_dir)
    model = _make_model(setup, cfg.seed)
    try:
        state = torch.load(run / "model.pt", map_location=cfg.device, weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:
        raise _not_a_run(
            run, f"model.pt does not load into the configured model: {type(exc).__name__}"
        ) from None
    # Shadows reuse the run's released preprocessing statistic (the DP centre of table features);
    # the rest of the layer is public and rebuilt from the plan.
    if "preprocess.offset" in state:
        setup.preprocess_state = {"offset": state["preprocess.offset"]}
    members = (data.x_train, data.y_train)
    nonmembers = (data.x_test, data.y_test)
    t0 = time.perf_counter()
    attacks = [loss_attack(model, members, nonmembers, device=cfg.device)]
    lira_seconds = 0.0
    if settings.uses_lira:
        rng = make_source(cfg.secure_rng, None if cfg.secure_rng else _child_seed(cfg.seed, 11))
        result, lira_seconds = _lira(setup, model, members, nonmembers, settings, sigma, rng)
        attacks.append(result)
    mia = _mia_section(attacks)
    report = AuditReport(
        epsilon_lower_bound=None,
        confidence=settings.confidence,
        epsilon_theoretical=theoretical,
        delta=cfg.delta,
        canaries=None,
        mia=mia,
        verdict=verdict(None, theoretical),
        reading=reading(None, theoretical, settings.confidence, cfg.delta, mia),
        source=f"veil audit --run {run}: the released model of a finished veil train run",
        run={
            "run": str(run),
            "dataset": data.name,
            "dataset_sha256": data.sha256,
            "model": setup.model_name,
            "n_train": data.n_train,
            "noise_multiplier": sigma,
            "epsilon_spent": theoretical,
            "seed": cfg.seed,
            "attack": settings.attack,
        },
        timing={"attacks_s": time.perf_counter() - t0, "shadow_training_s": lira_seconds},
        veil_version=_version(),
    )
    if write:
        _write(report, out_dir, _images(attacks, {}))
    return report


# ---------------------------------------------------------------------------------------------
# veil train --audit
# ---------------------------------------------------------------------------------------------
class OneRunAudit:
    """Gradient canaries attached to a run built elsewhere; :meth:`finish` gives the report section."""

    def __init__(self, canaries: GradientCanaries, confidence: float) -> None:
        self.canaries = canaries
        self.confidence = confidence

    def finish(self, *, delta: float, epsilon_theoretical: float | None) -> dict[str, Any]:
        """Stop injecting and return ``{epsilon_lower_bound, confidence, epsilon_theoretical, ...}``."""
        self.canaries.detach()
        b = self.canaries.bound(self.confidence, delta=delta)
        theo = (
            None
            if epsilon_theoretical is None or not math.isfinite(epsilon_theoretical)
            else epsilon_theoretical
        )
        return _finite(
            {
                "epsilon_lower_bound": b.epsilon,
                "confidence": self.confidence,
                "epsilon_theoretical": theo,
                "delta": delta,
                "verdict": verdict(b.epsilon, theo),
                "reading": reading(b.epsilon, theo, self.confidence, delta, None),
                "canaries": {
                    "count": self.canaries.count,
                    "gradient": {**self.canaries.summary(), "bound": b.to_dict()},
                },
            }
        )


def run_one_run_audit(
    model: nn.Module,
    optimizer: DPOptimizer,
    engine: PrivacyEngine,
    sample: tuple[np.ndarray, np.ndarray],
    *,
    canaries: int | None = None,
    confidence: float = 0.95,
    direction: Direction = "dirac",
    seed: int | None = None,
    secure_rng: bool = False,
    delta: float | None = None,
) -> OneRunAudit:
    """Attach white-box gradient canaries to a private run; call right after ``make_private``.

    ``sample``: a few training examples (inputs as the model takes them, labels) to find the quiet
    coordinates; ``delta`` (the run's δ), when given, is checked to leave the bound room (2mδ < 1)
    before the run starts. The canaries do not touch the data, the sampling or the noise of the real examples,
    so the run's guarantee for them is unchanged; the released weights do carry the canaries' pushes
    on their (quiet) coordinates. Returns an :class:`OneRunAudit`; after the last step call
    ``finish(delta=δ, epsilon_theoretical=ε)`` for the report section.
    """
    from veil.mechanisms.rng import make_source

    conf = check_confidence(confidence)
    if engine.plan is None or engine.sampling_rate is None:
        raise InvalidParameterError(
            "engine", "not private yet", "canaries join the run's Poisson sampling", "call make_private first"
        )
    if engine.plan.sampling != "poisson":
        raise InvalidParameterError(
            "sampling",
            engine.plan.sampling,
            "a canary must be sampled exactly like a record, which the audit does for Poisson sampling only",
            "audit a Poisson-sampled run",
        )
    rng = make_source(secure_rng, None if secure_rng or seed is None else _child_seed(seed, 11))
    design = GradientCanaries.design(
        model,
        canaries,
        rng=rng,
        max_grad_norm=float(engine.plan.max_grad_norm),
        direction=direction,
        sample=sample,
        expected_batch_size=optimizer.expected_batch_size,
        noise_multiplier=optimizer.noise_multiplier,
        cap=None if delta is None else _delta_cap(delta),
    )
    if delta is not None:
        _check_delta_room(design.count, delta)
    design.attach(optimizer, sampling_rate=float(engine.sampling_rate))
    return OneRunAudit(design, conf)
