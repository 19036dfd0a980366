"""``veil train`` as a function: :func:`train` runs one DP training job end to end, returns a :class:`Report`.

Flow: config → data (load, check, split) → model (zoo or the user's factory) → validate/fix →
preprocessing plan → σ calibrated so that the whole planned run (preprocessing included) fits the
target (ε, δ) → run folder (lock, ``config.toml``, ledger) → DP preprocessing release → DP-SGD with
Poisson sampling → evaluation → non-private baseline → ``report.json``, ``report.html``, plots,
``model.pt``.

Guarantee. The released weights (``model.pt``) are (ε_spent, δ)-DP for the training split under
add/remove-one neighbouring, where ε_spent is the accountant's ε for *every* event in the run's
ledger and never exceeds the target: before each step, the step's event is checked to fit and is
written and fsync'ed to the ledger before its noisy update is computed; training stops before a step
that would not fit. A resumed run charges every step ever recorded, including steps whose updates a
crash lost. Everything is validated (config, data, model, calibration, output folder) before the run
folder is created, so bad input leaves nothing behind and existing outputs untouched.

Not covered by the guarantee (documented in the report): the test accuracy and the non-private
baseline, which are computed without privacy for the report's reader, and N (treated as public).
"""

from __future__ import annotations

import copy
import io
import math
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.base import make_accountant
from veil.accounting.events import (
    Composed,
    Gaussian,
    PoissonSampled,
    PrivacyEvent,
    SelfComposed,
    event_from_dict,
)
from veil.accounting.ledger import Ledger, RunLock, atomic_write_bytes, atomic_write_text, file_sha256
from veil.config import (
    PRIVACY_KEYS,
    TrainConfig,
    apply_presets,
    load_config_file,
    make_config,
    preset_for,
    write_config,
)
from veil.errors import (
    BudgetExhaustedError,
    CheckpointError,
    ConfigError,
    InvalidParameterError,
    LedgerError,
    ModelNotSupportedError,
    SamplingError,
    UnreachableTargetError,
)
from veil.report import Check, DatasetInfo, Report

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.data import Dataset
    from veil.data.preprocess import PreprocessingPlan

__all__ = ["Report", "train"]

LEDGER = "ledger.jsonl"
CONFIG = "config.toml"
CHECKPOINTS = "checkpoints"
_CKPT_FORMAT = "veil.train.checkpoint/1"
_KEEP_CHECKPOINTS = 2
_CLIP_CHECK_EXAMPLES = 4
_CLIP_CHECK_TOLERANCE = 1e-6


# ----------------------------------------------------------------------------------------------
# Budget arithmetic
# ----------------------------------------------------------------------------------------------
def _epsilon(accountant: str, events: list[PrivacyEvent], delta: float) -> float:
    acc = make_accountant(accountant)  # type: ignore[arg-type]
    if events:
        acc.compose(Composed(events))
    return float(acc.epsilon(delta))


def _step_event(q: float, sigma: float) -> PrivacyEvent:
    return PoissonSampled(q, Gaussian(sigma))


def _with_steps(events: list[PrivacyEvent], step: PrivacyEvent, k: int) -> list[PrivacyEvent]:
    return [*events, SelfComposed(step, k)] if k > 0 else list(events)


def _calibrate(cfg: TrainConfig, q: float, steps: int, pre: list[PrivacyEvent]) -> float:
    """The smallest σ (to 0.2%) whose planned run (``pre`` then ``steps`` steps) stays within the target."""
    from veil.accounting.calibrate import calibrate_noise

    sigma0 = float(calibrate_noise(cfg.epsilon, cfg.delta, q, steps, accountant=cfg.accountant))
    if not pre:
        return sigma0
    if _epsilon(cfg.accountant, pre, cfg.delta) >= cfg.epsilon:
        raise UnreachableTargetError(
            "preprocessing_budget",
            cfg.preprocessing_budget,
            "the DP preprocessing alone already spends the whole target ε, leaving nothing for training",
            "lower preprocessing_budget, raise --epsilon, or declare public feature_bounds",
        )

    def fits(sigma: float) -> bool:
        return (
            _epsilon(cfg.accountant, _with_steps(pre, _step_event(q, sigma), steps), cfg.delta) <= cfg.epsilon
        )

    lo, hi = sigma0, sigma0 * 1.25
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise UnreachableTargetError(
                "epsilon", cfg.epsilon, "no noise level fits this run", "raise --epsilon"
            )
    while hi / lo > 1.002:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _allowed_steps(cfg: TrainConfig, events: list[PrivacyEvent], step: PrivacyEvent, want: int) -> int:
    """The most further steps (≤ want) whose ε, after ``events``, stays within the target."""

    def fits(k: int) -> bool:
        return _epsilon(cfg.accountant, _with_steps(events, step, k), cfg.delta) <= cfg.epsilon

    if want <= 0 or fits(want):
        return max(want, 0)
    lo, hi = 0, want  # fits(lo) may be False: then 0 steps are allowed
    if not fits(0):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _epsilon_curve(
    cfg: TrainConfig, pre: list[PrivacyEvent], step: PrivacyEvent, total: int
) -> list[tuple[int, float]]:
    points = sorted({0, total, *np.linspace(0, total, num=min(total, 12) + 1).round().astype(int).tolist()})
    return [(int(k), _epsilon(cfg.accountant, _with_steps(pre, step, int(k)), cfg.delta)) for k in points]


def _curve_at(curve: list[tuple[int, float]], k: int) -> float:
    """ε after k steps read off the curve, rounded up to the next computed point (conservative)."""
    for s, e in curve:
        if s >= k:
            return e
    return curve[-1][1]


# ----------------------------------------------------------------------------------------------
# Preparation: everything checked before anything is written
# ----------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    cfg: TrainConfig
    data: Dataset
    prep: PreprocessingPlan
    net: nn.Module
    model_name: str
    q: float
    steps_per_epoch: int
    steps_planned: int
    sigma: float
    step_event: PrivacyEvent
    pre_events: list[PrivacyEvent]
    allowed: int
    out: Path
    notes: list[str] = field(default_factory=list)
    feature_cache: dict[str, np.ndarray] = field(default_factory=dict)


def _load_data(cfg: TrainConfig) -> Dataset:
    from veil.data import load_dataset

    return load_dataset(
        cfg.dataset, data_dir=cfg.data_dir, target=cfg.target, test_fraction=cfg.test_fraction, seed=cfg.seed
    )


def _check_delta(cfg: TrainConfig, n: int) -> None:
    if cfg.delta >= 1.0 / n:
        raise InvalidParameterError(
            "delta",
            cfg.delta,
            f"δ ≥ 1/N (N = {n} training examples) allows a mechanism that publishes a whole record outright",
            f"pass a δ well below 1/N, e.g. --delta {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
        )


def _build_net(cfg: TrainConfig, data: Dataset) -> tuple[nn.Module, str]:
    import torch

    from veil.models import build_model, resolve_name
    from veil.validation import fix, validate

    name = resolve_name(cfg.model, data.kind, data.input_shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        net = build_model(cfg.model, data.input_shape, data.num_classes, data.kind)
    if validate(net):
        net = fix(net)
        problems = validate(net)
        if problems:
            raise ModelNotSupportedError(problems)
    return net, name


def _default_out(cfg: TrainConfig) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe = "".join(
        ch if ch.isalnum() or ch in "-_" else "-"
        for ch in Path(cfg.dataset.split(":")[-1]).stem or cfg.dataset
    )
    return Path("runs") / f"{safe}-{stamp}"


def _check_out(out: Path) -> None:
    """The run folder must be new (or empty) and creatable; nothing is left behind by the check."""
    if out.exists():
        if not out.is_dir():
            raise ConfigError("out", str(out), "it exists and is not a folder", "pass a new folder for --out")
        if (out / LEDGER).exists():
            raise ConfigError(
                "out",
                str(out),
                "it already holds a run, whose outputs and ledger must not be overwritten",
                f"continue it with --resume {out}, or pass another --out",
            )
        if any(out.iterdir()):
            raise ConfigError(
                "out", str(out), "the folder is not empty", "pass a new or empty folder for --out"
            )
    anchor = out
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise ConfigError(
            "out", str(out), f"'{anchor}' is a file, so the folder cannot be created", "pass another --out"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".veil-probe-", dir=anchor)
        os.rmdir(probe)
    except OSError as exc:
        raise ConfigError(
            "out",
            str(out),
            f"the folder cannot be written ({exc.strerror})",
            "pass a writable location for --out",
        ) from None


def _prepare(cfg: TrainConfig, out: Path | None, check_out: bool = True) -> _Plan:
    from veil.data.preprocess import plan_preprocessing
    from veil.engine import refuse_example_mixing
    from veil.sampling import steps_per_epoch

    data = _load_data(cfg)
    _check_delta(cfg, data.n_train)
    cfg = apply_presets(cfg, preset_for(cfg.model, data), data.n_train)
    assert cfg.batch_size is not None and cfg.epochs is not None
    if cfg.batch_size > data.n_train:
        raise SamplingError(
            "batch_size",
            cfg.batch_size,
            f"the sampling rate q = batch_size / N must be ≤ 1, and N = {data.n_train} training examples",
            f"pass --batch-size of at most {data.n_train}",
        )
    net, model_name = _build_net(cfg, data)
    prep = plan_preprocessing(cfg, data)
    pre_events = [prep.event] if prep.event is not None else []
    q = cfg.batch_size / data.n_train
    spe = steps_per_epoch(data.n_train, cfg.batch_size)
    planned = cfg.epochs * spe
    if cfg.noise_multiplier is not None:
        sigma = cfg.noise_multiplier
    else:
        sigma = _calibrate(cfg, q, planned, pre_events)
    step_event = _step_event(q, sigma)
    allowed = _allowed_steps(cfg, pre_events, step_event, planned)
    if allowed == 0:
        raise BudgetExhaustedError(
            "noise_multiplier",
            sigma,
            f"not even one training step fits the target ε = {cfg.epsilon:g}",
            "raise --noise-multiplier or --epsilon, or omit --noise-multiplier to calibrate it",
        )
    out_dir = Path(out if out is not None else (cfg.out or _default_out(cfg)))
    if check_out:
        _check_out(out_dir)
    cfg = cfg.model_copy(update={"out": str(out_dir)})
    plan = _Plan(
        cfg, data, prep, net, model_name, q, spe, planned, sigma, step_event, pre_events, allowed, out_dir
    )
    # Before anything is written: the whole model (a fixed feature front included, which the
    # engine never sees) must compute each example's output from that example alone.
    refuse_example_mixing(_assemble(plan, net), data.x_train, data.y_train)
    return plan


def _header(plan: _Plan) -> dict[str, Any]:
    import veil

    cfg = plan.cfg
    return {
        "veil_version": veil.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "accountant": cfg.accountant,
        "neighbouring": "add_or_remove_one",
        "target_epsilon": cfg.epsilon,
        "delta": cfg.delta,
        "noise_multiplier": plan.sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "sampling": "poisson",
        "sampling_rate": plan.q,
        "batch_size": cfg.batch_size,
        "steps_planned": plan.steps_planned,
        "dataset_sha256": plan.data.sha256,
        "n_train": plan.data.n_train,
        "preprocessing": plan.prep.method,
        "preprocessing_event": None if plan.prep.event is None else plan.prep.event.to_dict(),
        "step_event": plan.step_event.to_dict(),
        "secure_rng": cfg.secure_rng,
    }


# ----------------------------------------------------------------------------------------------
# Checks for the report
# ----------------------------------------------------------------------------------------------
def _clipping_check(model: nn.Module, plan: _Plan, criterion: nn.Module) -> Check:
    """The clipper's clipped sum against a per-example loop, on a float64 copy and synthetic inputs."""
    import torch

    from veil.clipping import PerSampleClipper

    data = plan.data
    gen = torch.Generator().manual_seed(plan.cfg.seed + 7)
    shape = (_CLIP_CHECK_EXAMPLES, *data.input_shape)
    if data.kind == "image" and data.pixel_max:
        x = torch.rand(shape, generator=gen, dtype=torch.float64) * data.pixel_max
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0
    y = torch.randint(0, data.num_classes, (_CLIP_CHECK_EXAMPLES,), generator=gen)
    reference = copy.deepcopy(model).double()
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads, norms = [], []
    for i in range(_CLIP_CHECK_EXAMPLES):
        loss = criterion(reference(x[i : i + 1]), y[i : i + 1])
        g = torch.autograd.grad(loss, [p for _, p in named])
        grads.append(g)
        norms.append(math.sqrt(sum(float((t**2).sum()) for t in g)))
    # A bound between the norms, so that the check covers clipped and unclipped examples.
    bound = float(np.median(norms)) or 1.0
    expected = {n: torch.zeros_like(p) for n, p in named}
    for g, nrm in zip(grads, norms, strict=True):
        factor = min(1.0, bound / max(nrm, 1e-300))
        for (n, _), t in zip(named, g, strict=True):
            expected[n].add_(t * factor)
    clipped = copy.deepcopy(model).double()
    names = {id(p): n for n, p in clipped.named_parameters()}
    clipper = PerSampleClipper(clipped, bound, loss_reduction="sum")
    try:
        loss = torch.nn.functional.cross_entropy(clipped(x), y, reduction="sum")
        loss.backward()
        clipper.accumulate()
        got = {names[id(p)]: t for p, t in zip(clipper.parameters, clipper.clipped_sum(), strict=True)}
    finally:
        clipper.remove()
    if set(got) != set(expected):
        rel = math.inf
    else:
        num = math.sqrt(sum(float(((got[n] - e) ** 2).sum()) for n, e in expected.items()))
        den = math.sqrt(sum(float((e**2).sum()) for e in expected.values())) or 1.0
        rel = num / den
    n_clipped = sum(1 for nrm in norms if nrm > bound)
    return Check(
        name="per_sample_clipping",
        passed=bool(rel < _CLIP_CHECK_TOLERANCE),
        detail=(
            f"the clipper's clipped gradient sum on this model matches a per-example reference loop "
            f"(float64, {_CLIP_CHECK_EXAMPLES} synthetic examples, "
            f"{n_clipped} clipped): relative error {rel:.2e} "
            f"(tolerance {_CLIP_CHECK_TOLERANCE:g})"
        ),
    )


def _checks(
    plan: _Plan, eps: float, engine_eps: float, engine: Any, ledger: Ledger, clip_check: Check
) -> list[Check]:
    cfg = plan.cfg
    n = plan.data.n_train
    step_events = {r["event"]["type"] + str(r["event"].get("sampling_rate")) for r in ledger.of_kind("step")}
    poisson_ok = (
        engine.sampling == "poisson"
        and math.isclose(float(engine.sampling_rate), plan.q, rel_tol=0, abs_tol=0)
        and math.isclose(float(engine.noise_multiplier), plan.sigma, rel_tol=0, abs_tol=0)
        and step_events <= {f"poisson_sampled{plan.q}"}
    )
    pre_records = list(ledger.of_kind("event"))
    if plan.prep.public:
        data_detail = f"preprocessing is public ({plan.prep.description})"
        data_ok = not pre_records
    else:
        assert plan.prep.event is not None
        data_ok = bool(pre_records) and all(
            event_from_dict(r["event"]) == plan.prep.event for r in pre_records
        )
        data_detail = (
            f"preprocessing is a DP release charged in the ledger ({plan.prep.description}; "
            f"{len(pre_records)} release(s), event {plan.prep.event.to_json()})"
        )
    return [
        Check(
            name="epsilon_reported",
            passed=bool(math.isfinite(eps) and eps <= cfg.epsilon and engine_eps <= eps + 1e-9),
            detail=(
                f"ε = {eps:.6g} ≤ target {cfg.epsilon:g} at δ = "
                f"{cfg.delta:g}, composed by the {cfg.accountant} "
                f"accountant from all {len(ledger.events())} events "
                "in the ledger (the engine's own accountant, "
                f"which saw only this process's steps, reports {engine_eps:.6g})"
            ),
        ),
        Check(
            name="delta_below_1_over_n",
            passed=bool(cfg.delta < 1.0 / n),
            detail=f"δ = {cfg.delta:g} < 1/N = {1.0 / n:.3g} (N = {n})",
        ),
        Check(
            name="poisson_sampling_matches_accountant",
            passed=bool(poisson_ok),
            detail=(
                "batches drawn by Poisson sampling (each example "
                f"independently with q = {plan.q:.6g}); every step "
                "in the ledger is accounted as PoissonSampled(q "
                f"= {plan.q:.6g}, Gaussian(σ = {plan.sigma:.6g}))"
            ),
        ),
        clip_check,
        Check(
            name="no_unaccounted_data_use",
            passed=bool(data_ok),
            detail=(
                f"{data_detail}; model '{plan.model_name}' and "
                "hyperparameters come from the configuration and "
                "veil's presets, not from the private data; the "
                "final iterate is released (no model selection "
                "or early stopping on private data)"
            ),
        ),
    ]


# ----------------------------------------------------------------------------------------------
# Training pieces
# ----------------------------------------------------------------------------------------------
def _assemble(plan: _Plan, net: nn.Module) -> nn.Sequential:
    from torch import nn

    from veil.data.preprocess import build_transform

    return nn.Sequential(OrderedDict(preprocess=build_transform(plan.prep, plan.data.input_shape), net=net))


@dataclass
class _Trainable:
    """What DP-SGD trains, and on which inputs.

    For a model with a fixed front (:class:`veil.models.FixedFeaturesThenHead`) the front and the
    public preprocessing are applied once to every example (a fixed per-example map: no privacy
    cost, see its docstring) and only the head is trained, on the features; ``full`` (the released
    model) shares the head's parameters and maps raw inputs. Otherwise ``model`` is ``full``.
    """

    full: nn.Module
    model: nn.Module
    x_train: np.ndarray
    x_test: np.ndarray


def _trainable(plan: _Plan, net: nn.Module, device: str) -> _Trainable:
    from veil.models import fixed_features, split_fixed_front

    full = _assemble(plan, net).to(device)
    data = plan.data
    front, head = split_fixed_front(full)
    if front is None:
        return _Trainable(full, full, data.x_train, data.x_test)
    if not plan.feature_cache:  # the front was probed with the whole model by _prepare
        for split, x in (("train", data.x_train), ("test", data.x_test)):
            plan.feature_cache[split] = fixed_features(front, x, device)
    return _Trainable(full, head, plan.feature_cache["train"], plan.feature_cache["test"])


def _make_optimizer(cfg: TrainConfig, params: Any, private: bool = True) -> torch.optim.Optimizer:
    import torch

    assert cfg.lr is not None
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum or 0.0)


def _evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, device: str, batch: int = 2048
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on ``x, y``."""
    import torch

    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb = torch.as_tensor(x[i : i + batch], device=device)
            yb = torch.as_tensor(y[i : i + batch], device=device)
            out = model(xb)
            total_loss += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return total_loss / len(x), correct / len(x)


def _baseline(plan: _Plan, device: str) -> tuple[float, list[dict[str, float]]]:
    """The same model, split, preprocessing and epochs, trained without privacy (Adam, shuffled batches).

    Adam at 1e-3 for the CNN and 1e-2 for the linear models, batches of 32 (128 above 10 000
    examples): standard non-private settings, so the utility drop is measured against a fair baseline.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    cfg, data = plan.cfg, plan.data
    assert cfg.epochs is not None
    net, _ = _build_net(cfg, data)
    view = _trainable(plan, net, device)
    model = view.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 if plan.model_name == "cnn" else 1e-2)
    gen = torch.Generator().manual_seed(_child_seed(cfg.seed, 3))
    loader = DataLoader(
        TensorDataset(torch.from_numpy(view.x_train), torch.from_numpy(data.y_train)),
        batch_size=32 if data.n_train < 10_000 else 128,
        shuffle=True,
        generator=gen,
    )
    history: list[dict[str, float]] = []
    acc = 0.0
    for epoch in range(1, cfg.epochs + 1):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
        loss, acc = _evaluate(model, view.x_test, data.y_test, device)
        history.append({"epoch": float(epoch), "test_loss": loss, "test_accuracy": acc})
    return acc, history


def _child_seed(seed: int, purpose: int) -> int:
    return int(np.random.SeedSequence([seed, purpose]).generate_state(1)[0])


# ----------------------------------------------------------------------------------------------
# Checkpoints and the released preprocessing statistic
# ----------------------------------------------------------------------------------------------
def _save_checkpoint(run_dir: Path, ledger: Ledger, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically, then record its sha256 in the ledger; keep the last two."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    folder = run_dir / CHECKPOINTS
    folder.mkdir(exist_ok=True)
    name = f"step-{state['charged']:07d}.pt"
    atomic_write_bytes(folder / name, data)
    import hashlib

    ledger.append(
        "checkpoint",
        charged=state["charged"],
        applied=state["applied"],
        file=f"{CHECKPOINTS}/{name}",
        sha256=hashlib.sha256(data).hexdigest(),
    )
    keep = {r["file"] for r in list(ledger.of_kind("checkpoint"))[-_KEEP_CHECKPOINTS:]}
    for old in folder.glob("step-*.pt"):
        if f"{CHECKPOINTS}/{old.name}" not in keep:
            old.unlink(missing_ok=True)


def _load_checkpoint(run_dir: Path, ledger: Ledger) -> dict[str, Any] | None:
    """The last checkpoint the ledger recorded, verified against its sha256; None if there is none."""
    import torch

    record = ledger.last("checkpoint")
    if record is None:
        return None
    path = run_dir / record["file"]
    fix = (
        "restore the checkpoint from a backup, or start a new run with another --out "
        "(the ledger keeps the spent budget)"
    )
    if not path.is_file():
        raise CheckpointError(
            "checkpoint", str(path), "the checkpoint the ledger recorded last is missing", fix
        )
    if file_sha256(path) != record["sha256"]:
        raise CheckpointError(
            "checkpoint",
            str(path),
            "its sha256 does not match the one recorded in the ledger: it is corrupted or was replaced",
            fix,
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pragma: no cover - the checksum matched, so this is a version problem
        raise CheckpointError("checkpoint", str(path), f"it cannot be read ({exc})", fix) from None
    if not isinstance(state, dict) or state.get("format") != _CKPT_FORMAT:
        raise CheckpointError("checkpoint", str(path), "not a veil training checkpoint", fix)
    return state


def _front_fingerprint(net: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor | None:
    """A fixed feature map's output on a public probe (uniform noise in [0, 1) from a constant seed:
    no private data), or None for a model without one. The map is rebuilt, not saved, when a run
    resumes, and a checkpointed head only fits the features it was trained on."""
    import torch

    from veil.models import FixedFeaturesThenHead

    if not isinstance(net, FixedFeaturesThenHead):
        return None
    probe = torch.rand((2, *input_shape), generator=torch.Generator().manual_seed(0))
    device = next(iter(net.features.buffers()), probe).device
    with torch.no_grad():
        return net.features(probe.to(device)).double().cpu()


def _check_front_fingerprint(state: dict[str, Any], now: torch.Tensor | None, run_dir: Path) -> None:
    import torch

    if "front_fingerprint" not in state:  # a checkpoint written before veil recorded one
        return
    before = state["front_fingerprint"]
    same = (before is None and now is None) or (
        before is not None
        and now is not None
        and before.shape == now.shape
        and bool(torch.allclose(before, now, rtol=1e-4, atol=1e-6))
    )
    if not same:
        raise CheckpointError(
            "checkpoint",
            str(run_dir),
            "the model's fixed feature front, rebuilt now, differs from the one the checkpointed head "
            "was trained on (another model setting, or another torch version drawing its random features)",
            "resume with the run's own config.toml and the torch version that started it, or start a new run",
        )


def _ensure_preprocessing(plan: _Plan, run_dir: Path, ledger: Ledger) -> None:
    """Release the DP preprocessing statistic once per run (charged first), or reuse the released one."""
    import hashlib
    import json

    from veil.data.preprocess import restore_preprocessing, run_preprocessing
    from veil.mechanisms.rng import make_source

    if plan.prep.public:
        return
    assert plan.prep.event is not None
    path = _verified_preprocessing_file(run_dir, ledger)
    if path is not None:
        restore_preprocessing(plan.prep, json.loads(path.read_text()))
        return
    cfg = plan.cfg
    if _epsilon(cfg.accountant, [*ledger.events(), plan.prep.event], cfg.delta) > cfg.epsilon:
        raise BudgetExhaustedError(
            "preprocessing",
            plan.prep.method,
            "releasing the preprocessing statistic again would pass the target ε",
            "start a new run with another --out",
        )
    ledger.append("event", label="preprocessing", method=plan.prep.method, event=plan.prep.event.to_dict())
    rng = make_source(
        cfg.secure_rng,
        None if cfg.secure_rng else _child_seed(cfg.seed, 1 + len(list(ledger.of_kind("event")))),
    )
    run_preprocessing(plan.prep, plan.data, rng)
    data = json.dumps(plan.prep.released, sort_keys=True).encode()
    atomic_write_bytes(run_dir / "preprocessing.json", data)
    ledger.append("preprocessing", file="preprocessing.json", sha256=hashlib.sha256(data).hexdigest())


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def _execute(plan: _Plan, run_dir: Path, ledger: Ledger, t0: float, progress: bool | None) -> Report:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from veil.engine import PrivacyEngine
    from veil.progress import TrainingProgress, progress_enabled

    cfg, data = plan.cfg, plan.data
    assert cfg.max_grad_norm is not None and cfg.epochs is not None and cfg.batch_size is not None
    device = cfg.device
    _ensure_preprocessing(plan, run_dir, ledger)
    net, _ = _build_net(cfg, data)
    view = _trainable(plan, net, device)
    model = view.model
    criterion = nn.CrossEntropyLoss()
    clip_check = _clipping_check(view.full, plan, criterion)
    optimizer = _make_optimizer(cfg, model.parameters())
    engine = PrivacyEngine(
        accountant=cfg.accountant,
        secure_rng=cfg.secure_rng,
        seed=None if cfg.secure_rng else _child_seed(cfg.seed, 2),
    )
    loader = DataLoader(
        TensorDataset(torch.from_numpy(view.x_train), torch.from_numpy(data.y_train)),
        batch_size=cfg.batch_size,
    )
    model, dp_optimizer, dp_loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=plan.sigma,
        max_grad_norm=cfg.max_grad_norm,
        criterion=criterion,
        physical_batch_size=cfg.physical_batch_size,
    )
    assert engine.plan is not None
    if engine.plan.event != plan.step_event or engine.plan.steps_per_epoch != plan.steps_per_epoch:
        raise LedgerError(  # pragma: no cover - both derive from the same settings
            "engine",
            engine.plan.event.to_json(),
            "the engine would account steps differently from the ledger",
            "report this as a bug",
        )

    one_run = None
    if cfg.audit:
        from veil.audit.run import run_one_run_audit

        # Canaries on random coordinates: placing them needs no private data (an empty sample).
        one_run = run_one_run_audit(
            model,
            dp_optimizer,
            engine,
            (view.x_train[:0], data.y_train[:0]),
            canaries=cfg.audit_canaries,
            confidence=cfg.audit_confidence,
            seed=None if cfg.secure_rng else _child_seed(cfg.seed, 11),
            secure_rng=cfg.secure_rng,
            delta=cfg.delta,
        )

    history: list[dict[str, float]] = []
    applied = 0
    state = _load_checkpoint(run_dir, ledger)
    fingerprint = _front_fingerprint(net, data.input_shape)
    if state is not None:
        model.load_state_dict(state["model"])
        dp_optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
        history = list(state["history"])
        applied = int(state["applied"])
    # The released weights: an exponential moving average of the DP iterates (post-processing, so
    # free of privacy cost), evaluated on a hook-free copy of the model.
    ema = {
        k: v.detach().clone() for k, v in (state["ema"] if state is not None else model.state_dict()).items()
    }
    released = _trainable(plan, _build_net(cfg, data)[0], device)
    eval_model = released.model

    averaged = {name for name, _ in model.named_parameters()}

    def update_ema() -> None:
        d = min(cfg.ema_decay or 0.0, (1 + applied) / (10 + applied))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                # Only parameters are averaged; buffers (e.g. ±inf clipping bounds) are copied, and
                # so is everything when averaging is off (0·inf would be NaN).
                if d > 0 and k in averaged and v.is_floating_point():
                    ema[k].mul_(d).add_(v.detach(), alpha=1 - d)
                else:
                    ema[k].copy_(v)

    def evaluate() -> tuple[float, float]:
        eval_model.load_state_dict(ema)
        return _evaluate(eval_model, view.x_test, data.y_test, device)

    step_dict = plan.step_event.to_dict()
    limit = ledger.steps + _allowed_steps(
        cfg, ledger.events(), plan.step_event, plan.steps_planned - ledger.steps
    )
    stop_reason = None
    if limit < plan.steps_planned:
        stop_reason = f"the budget allows {limit} of the {plan.steps_planned} planned steps " + (
            "at the given noise multiplier"
            if cfg.noise_multiplier is not None
            else "after the charges of interrupted runs"
        )
    base_events = [
        e for r, e in zip(_event_records(ledger), ledger.events(), strict=True) if r["kind"] == "event"
    ]
    curve = _epsilon_curve(cfg, base_events, plan.step_event, plan.steps_planned)
    spe = plan.steps_per_epoch

    def checkpoint() -> None:
        _save_checkpoint(
            run_dir,
            ledger,
            {
                "format": _CKPT_FORMAT,
                "charged": ledger.steps,
                "applied": applied,
                "model": model.state_dict(),
                "ema": ema,
                "optimizer": dp_optimizer.state_dict(),
                "engine": engine.state_dict(),
                "history": history,
                "front_fingerprint": fingerprint,
            },
        )

    last_saved = ledger.steps if state is not None else -1
    running: list[float] = []
    with TrainingProgress(
        progress_enabled(progress if progress is not None else cfg.progress), limit, cfg.epochs
    ) as bar:
        bar.update(
            step=ledger.steps, epoch=ledger.steps // spe, loss=None, epsilon=_curve_at(curve, ledger.steps)
        )
        new_logical = True
        while ledger.steps < limit or not new_logical:
            for xb, yb in dp_loader:
                if new_logical:
                    if ledger.steps >= limit:
                        break
                    # Charged and on disk before this step's noisy update is computed.
                    ledger.append("step", step=ledger.steps + 1, event=step_dict)
                loss = criterion(model(xb.to(device)), yb.to(device))
                loss.backward()
                dp_optimizer.step()
                dp_optimizer.zero_grad()
                loss_value = float(loss.detach())
                if len(yb) and math.isfinite(loss_value):
                    running.append(loss_value)
                new_logical = dp_loader.signal.last_chunk
                if not new_logical:
                    continue
                applied += 1
                update_ema()
                k = ledger.steps
                if k % spe == 0 or k == limit:
                    test_loss, test_acc = evaluate()
                    history.append(
                        {
                            "epoch": k / spe,
                            "step": float(k),
                            "epsilon": _curve_at(curve, k),
                            "test_loss": test_loss,
                            "test_accuracy": test_acc,
                        }
                    )
                if k % cfg.checkpoint_every == 0:
                    checkpoint()
                    last_saved = k
                bar.update(
                    step=k,
                    epoch=math.ceil(k / spe),
                    loss=float(np.mean(running[-20:])) if running else None,
                    epsilon=_curve_at(curve, k),
                )
    if last_saved != ledger.steps:
        checkpoint()

    eps = _epsilon(cfg.accountant, ledger.events(), cfg.delta)
    engine_eps = float(engine.get_epsilon(cfg.delta))
    if eps > cfg.epsilon:  # pragma: no cover - every step was checked to fit
        raise BudgetExhaustedError(
            "epsilon_spent", eps, "the ledger's ε passed the target", "report this as a bug"
        )
    audit = None if one_run is None else one_run.finish(delta=cfg.delta, epsilon_theoretical=eps)
    test_loss, test_acc = evaluate()
    if ledger.last("end") is None or ledger.last("end")["charged"] != ledger.steps:  # type: ignore[index]
        ledger.append("end", charged=ledger.steps, applied=applied, epsilon=eps)

    baseline_acc: float | None = None
    baseline_history: list[dict[str, float]] = []
    if cfg.baseline:
        baseline_acc, baseline_history = _baseline(plan, device)
    checks = _checks(plan, eps, engine_eps, engine, ledger, clip_check)
    return _write_outputs(
        plan,
        run_dir,
        ledger,
        released.full,
        eps=eps,
        test_acc=test_acc,
        baseline_acc=baseline_acc,
        history={"dp": history, "baseline": baseline_history},
        checks=checks,
        curve=curve,
        stop_reason=stop_reason,
        duration=time.monotonic() - t0,
        audit=audit,
    )


def _event_records(ledger: Ledger) -> list[dict[str, Any]]:
    return [r for r in ledger.records if "event" in r]


_FILES = {
    "report.json": "this report, machine-readable",
    "report.html": "this report as a page",
    "epsilon.png": "ε spent against the step",
    "curves.png": "test loss and accuracy per epoch, DP and baseline",
    "model.pt": "the DP model's state_dict (torch.load(path, "
    "weights_only=True)); preprocessing included as buffers",
    "config.toml": "the resolved configuration",
    LEDGER: "the privacy ledger: every charged event, hash-chained",
    CHECKPOINTS: "the last checkpoints (resume with --resume)",
}


def _write_outputs(
    plan: _Plan,
    run_dir: Path,
    ledger: Ledger,
    model: nn.Module,
    *,
    eps: float,
    test_acc: float,
    baseline_acc: float | None,
    history: dict[str, list[dict[str, float]]],
    checks: list[Check],
    curve: list[tuple[int, float]],
    stop_reason: str | None,
    duration: float,
    audit: dict[str, Any] | None = None,
) -> Report:
    import torch

    import veil
    from veil.report.html import render_html
    from veil.report.plots import curves_png, epsilon_png

    cfg, data = plan.cfg, plan.data
    assert (
        cfg.max_grad_norm is not None
        and cfg.batch_size is not None
        and cfg.epochs is not None
        and cfg.lr is not None
    )
    files = dict(_FILES)
    if not plan.prep.public:
        files["preprocessing.json"] = "the released DP preprocessing statistic"
    report = Report(
        epsilon_spent=eps,
        target_epsilon=cfg.epsilon,
        delta=cfg.delta,
        accountant=cfg.accountant,
        noise_multiplier=plan.sigma,
        max_grad_norm=cfg.max_grad_norm,
        sampling_rate=plan.q,
        batch_size=cfg.batch_size,
        steps=ledger.steps,
        steps_planned=plan.steps_planned,
        epochs=cfg.epochs,
        stopped_early=stop_reason is not None,
        stop_reason=stop_reason,
        preprocessing={
            "method": plan.prep.method,
            "description": plan.prep.description,
            "public": plan.prep.public,
            "event": None if plan.prep.event is None else plan.prep.event.to_dict(),
        },
        dataset=DatasetInfo(
            name=data.name,
            n_train=data.n_train,
            n_test=data.n_test,
            sha256=data.sha256,
            kind=data.kind,
            num_classes=data.num_classes,
        ),
        model=plan.model_name,
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        optimizer=cfg.optimizer or "sgd",
        lr=cfg.lr,
        test_accuracy=test_acc,
        baseline_test_accuracy=baseline_acc,
        utility_drop=None if baseline_acc is None else baseline_acc - test_acc,
        seed=cfg.seed,
        secure_rng=cfg.secure_rng,
        veil_version=veil.__version__,
        duration_s=duration,
        resumes=sum(1 for _ in ledger.of_kind("resume")),
        checks=checks,
        audit=audit,
        history=history,
        files=files,
        out_dir=str(run_dir),
    )
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    atomic_write_bytes(run_dir / "model.pt", buf.getvalue())
    eps_png = epsilon_png(curve, cfg.epsilon, ledger.steps, cfg.delta)
    curves = curves_png(history["dp"], history["baseline"])
    atomic_write_bytes(run_dir / "epsilon.png", eps_png)
    atomic_write_bytes(run_dir / "curves.png", curves)
    atomic_write_text(
        run_dir / "report.html",
        render_html(
            report,
            {"ε spent against the step": eps_png, "Test loss and accuracy, DP against non-private": curves},
        ),
    )
    atomic_write_text(run_dir / "report.json", report.to_json())
    return report


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
# Settings that may differ on --resume: they cannot change what was or will be charged.
_RESUME_MUTABLE = frozenset(
    {"out", "progress", "baseline", "device", "physical_batch_size", "checkpoint_every"}
)
_HEADER_KEYS = (
    "accountant",
    "target_epsilon",
    "delta",
    "noise_multiplier",
    "max_grad_norm",
    "sampling_rate",
    "batch_size",
    "steps_planned",
    "dataset_sha256",
    "n_train",
    "preprocessing",
    "preprocessing_event",
    "step_event",
    "secure_rng",
)


def _intact(run_dir: Path) -> bool:
    """Whether the ledger ends with a complete line (else an interrupted append awaits its repair)."""
    data = (run_dir / LEDGER).read_bytes()
    return not data or data.endswith(b"\n")


def _verify_files(run_dir: Path, ledger: Ledger | None) -> None:
    """Refuse a resume whose recorded checkpoint or preprocessing file is missing or altered (no writes)."""
    if ledger is None:
        return
    _load_checkpoint(run_dir, ledger)
    _verified_preprocessing_file(run_dir, ledger)


def _verified_preprocessing_file(run_dir: Path, ledger: Ledger) -> Path | None:
    """The recorded preprocessing release of this run (checksum verified), or None if none was made."""
    done = ledger.last("preprocessing")
    if done is None:
        return None
    path = run_dir / done["file"]
    if not path.is_file() or file_sha256(path) != done["sha256"]:
        raise CheckpointError(
            "preprocessing",
            str(path),
            "the released preprocessing statistic is missing or does not match its checksum",
            "restore it from a backup, or start a new run with another --out",
        )
    return path


def _resume(run_dir: Path, overrides: Mapping[str, Any], progress: bool | None, t0: float) -> Report:
    if not (run_dir / LEDGER).is_file() or not (run_dir / CONFIG).is_file():
        raise CheckpointError(
            "resume",
            str(run_dir),
            "there is no veil run in this folder (no ledger.jsonl and config.toml), so nothing to continue",
            "pass the --out folder of an earlier veil train run",
        )
    with RunLock(run_dir):
        saved = make_config(load_config_file(run_dir / CONFIG), source="saved config")
        update: dict[str, Any] = {}
        for key, value in overrides.items():
            if value is None or key in ("resume",):
                continue
            if key in _RESUME_MUTABLE:
                update[key] = value
            elif getattr(saved, key) != value:
                kind = "privacy setting" if key in PRIVACY_KEYS else "setting"
                raise CheckpointError(
                    key,
                    value,
                    f"resuming with a changed {kind}: the run was planned "
                    f"and accounted with {key}={getattr(saved, key)!r}",
                    f"resume without changing {key}, or start a new run with another --out",
                )
        cfg = saved.model_copy(update={**update, "out": str(run_dir)})
        if cfg.audit:
            raise ConfigError(
                "audit",
                True,
                "the canaries injected before the interruption were lost with the process, so the "
                "audit's guesses could not be scored against them",
                "run the audit in an uninterrupted run, or audit the finished run with veil audit --run",
            )
        _verify_files(run_dir, Ledger.open(run_dir / LEDGER, repair=False) if _intact(run_dir) else None)
        ledger = Ledger.open(run_dir / LEDGER, repair=True)
        try:
            plan = _prepare(cfg, run_dir, check_out=False)
            header = _header(plan)
            for key in _HEADER_KEYS:
                if ledger.header.get(key) != header[key]:
                    raise CheckpointError(
                        f"ledger header {key}",
                        ledger.header.get(key),
                        f"the run was accounted with {key}={ledger.header.get(key)!r} "
                        "but would now continue with "
                        f"{header[key]!r} (changed data, settings or veil version)",
                        "restore the original data and settings, or start a new run with another --out",
                    )
            state = _load_checkpoint(run_dir, ledger)
            if state is not None:
                _check_front_fingerprint(state, _front_fingerprint(plan.net, plan.data.input_shape), run_dir)
            ledger.append("resume", charged=ledger.steps)
            return _execute(plan, run_dir, ledger, t0, progress)
        finally:
            ledger.close()


def train(
    config: TrainConfig | Mapping[str, Any] | None = None,
    *,
    resume: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> Report:
    """Run ``veil train``: DP training to the configured target, returning the :class:`Report`.

    ``config``: a :class:`~veil.config.TrainConfig` or a dict of its fields (unset ones take the
    defaults and tuned presets). ``resume``: the folder of an interrupted run to continue; ``config``
    may then only repeat its settings (or change performance-only ones). ``progress``: force the
    progress bar on or off (default: on when stdout is a terminal). See the module docstring for the
    guarantee.
    """
    t0 = time.monotonic()
    if resume is not None:
        if isinstance(config, TrainConfig):
            overrides: dict[str, Any] = {k: getattr(config, k) for k in config.model_fields_set}
        else:
            overrides = dict(make_config(config or {}).model_dump(exclude_unset=True))
        return _resume(Path(resume), overrides, progress, t0)
    cfg = config if isinstance(config, TrainConfig) else make_config(config or {})
    plan = _prepare(cfg, None)
    run_dir = plan.out
    run_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir):
        ledger = Ledger.create(run_dir / LEDGER, _header(plan))  # exclusive: never over another run
        try:
            write_config(plan.cfg, run_dir / CONFIG)
            return _execute(plan, run_dir, ledger, t0, progress)
        finally:
            ledger.close()
