"""The accounted DP-SGD run of ``veil train`` (and of any job that trains with a ledger).

Guarantee. The caller passes the last step the budget allows; each logical step's event is appended
and fsync'ed to the ledger *before* its noisy update is computed. A DP preprocessing release is
charged before it is made and is made once per run (a resume reuses the released file, verified
against its checksum). The released weights are an exponential moving average of the DP iterates
(post-processing: no privacy cost). Test metrics are diagnostics computed without privacy.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from veil.accounting.calibrate import epsilon_at, epsilon_of
from veil.accounting.ledger import Ledger
from veil.distributed.runtime import rank_and_world
from veil.errors import BudgetExhaustedError, LedgerError
from veil.pipeline import checkpoints as ckpt
from veil.pipeline.budget import StepPlan
from veil.pipeline.checks import clipping_check
from veil.pipeline.data import Prepared, UsesPrepared, release_preprocessing
from veil.pipeline.model import (
    Trainable,
    assemble,
    build_net,
    evaluate,
    make_engine,
    make_optimizer,
    trainable,
)
from veil.pipeline.run_folder import write_files

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.engine import PrivacyEngine
    from veil.optimizer import DPOptimizer
    from veil.report import Check

__all__ = [
    "AttachAudit",
    "RunAudit",
    "RunPlan",
    "Session",
    "checkpoint",
    "ensure_preprocessing",
    "ensure_whitening",
    "evaluate_released",
    "install_whitening",
    "start",
    "train_steps",
    "trainable_view",
]


class RunAudit(Protocol):
    """An audit attached to a run by its job (``veil train --audit``:
    :class:`veil.audit.hook.OneRunAudit`): the loop only carries it; the job finishes it."""

    def finish(self, *, delta: float, epsilon_theoretical: float | None) -> dict[str, Any]: ...


AttachAudit = Callable[[Any, "nn.Module", "DPOptimizer", "PrivacyEngine", np.ndarray], RunAudit]
"""``(cfg, private model, DP optimizer, engine, training inputs) -> RunAudit``: a job's audit hook,
called by :func:`start` right after ``make_private`` (the pipeline imports no audit code)."""


@dataclass
class RunPlan(UsesPrepared):
    """A checked run before anything is written: inputs, network, step plan, allowed steps, folder."""

    prepared: Prepared
    net: nn.Module
    steps: StepPlan
    allowed: int
    out: Path
    feature_cache: dict[str, np.ndarray] = field(default_factory=dict)
    whitener: np.ndarray | None = None
    """``P`` once the cached rows are whitened (:func:`ensure_whitening`): installed in the released
    model at the end (:func:`install_whitening`)."""


def trainable_view(plan: RunPlan, net: nn.Module, device: str) -> tuple[Trainable, np.ndarray, np.ndarray]:
    """What DP-SGD trains, and its train and test inputs (a fixed front's features, computed once)."""
    view = trainable(assemble(plan.prep, plan.data.input_shape, net).to(device))
    data = plan.data
    if view.front is None:
        return view, data.x_train, data.x_test
    if not plan.feature_cache:  # the front was probed with the whole model by the job (veil.training.prepare)
        for split, x in (("train", data.x_train), ("test", data.x_test)):
            plan.feature_cache[split] = view.inputs(x, device)
    return view, plan.feature_cache["train"], plan.feature_cache["test"]


def _charge_release(plan: RunPlan, ledger: Ledger, label: str, method: str, event: Any) -> int:
    """Charge a one-off release made before the steps (refused if it would pass the target ε);
    returns its index among the run's releases (the seed derivation's, in research mode)."""
    cfg = plan.cfg
    if epsilon_of([*ledger.events(), event], cfg.delta, cfg.accountant) > cfg.epsilon:
        raise BudgetExhaustedError(
            label,
            method,
            f"releasing the {label} statistic again would pass the target ε",
            "the run ends here, its spend recorded; see veil budget show for what remains of the dataset's "
            "budget before planning another run",
        )
    released_before = len(list(ledger.of_kind("event")))
    ledger.append("event", label=label, method=method, event=event.to_dict())
    return released_before


def _record_release(run_dir: Path, ledger: Ledger, kind: str, name: str, data: bytes) -> None:
    """Write a released statistic into the run folder (never under ``release/``) and its checksum to
    the ledger, so that a resume reuses it instead of releasing it again."""
    write_files(run_dir, {name: data})
    ledger.append(kind, file=name, sha256=hashlib.sha256(data).hexdigest())


def ensure_preprocessing(plan: RunPlan, run_dir: Path, ledger: Ledger) -> None:
    """Release the DP preprocessing statistic once per run (charged first), or reuse the released one."""
    from veil.data.preprocess import restore_preprocessing

    if plan.prep.public:
        return
    assert plan.prep.event is not None
    path = ckpt.verified_preprocessing_file(run_dir, ledger)
    if path is not None:
        restore_preprocessing(plan.prep, json.loads(path.read_text()))
        return
    index = _charge_release(plan, ledger, "preprocessing", plan.prep.method, plan.prep.event)
    release_preprocessing(plan.prepared, index=index)
    data = json.dumps(plan.prep.released, sort_keys=True).encode()
    _record_release(run_dir, ledger, "preprocessing", "preprocessing.json", data)


WHITENING_FILE = "whitening.npy"
"""The released Gram matrix (float32) in the run folder: internal (kept out of ``release/``), read back
by a resume so that it whitens with the same ``P``."""


def ensure_whitening(plan: RunPlan, run_dir: Path, ledger: Ledger) -> None:
    """The scattering preset's whitening (:mod:`veil.data.whitening`): release the Gram matrix of the
    cached training rows once per run (its ``Gaussian(S)`` event charged first, before any step), or
    reuse the released one on a resume; then map the cached train and test rows in place through
    :class:`~veil.models.scattering.WhitenedRows` (``zP`` rescaled to the row norm), once per process.
    Nothing to do without ``Prepared.whitening``."""
    import io

    import torch

    from veil.data.whitening import eigh_ready, release_gram, whiten_rows_, whitener
    from veil.models.scattering import WhitenedRows
    from veil.pipeline.randomness import private_source
    from veil.pipeline.seeds import Purpose

    w = plan.prepared.whitening
    if w is None or plan.whitener is not None:
        return
    x_train, x_test = plan.feature_cache["train"], plan.feature_cache["test"]
    path = ckpt.verified_preprocessing_file(run_dir, ledger, "whitening")
    if path is not None:
        gram = np.load(path)
    else:
        cfg = plan.cfg
        index = _charge_release(plan, ledger, "whitening", "gram", w.event)
        noise = private_source(cfg.reproducible, cfg.seed, Purpose.PREPROCESSING, index)
        gram = release_gram(x_train, w.std, noise)
        buf = io.BytesIO()
        np.save(buf, gram)
        _record_release(run_dir, ledger, "whitening", WHITENING_FILE, buf.getvalue())
        del buf
    work = eigh_ready(gram)  # float64, overwritten by the eigendecomposition
    del gram
    p = whitener(work, plan.prepared.n_planned, w.ridge)  # a public count (tune: ⌊(1 − F)·N⌋)
    del work
    rule = WhitenedRows(w.row_norm)
    rule.set_whitener(torch.from_numpy(p))
    for rows in (x_train, x_test):
        whiten_rows_(rows, rule)
    plan.whitener = p


def install_whitening(plan: RunPlan, full: nn.Module) -> None:
    """Put the released ``P`` into the released model's :class:`~veil.models.scattering.WhitenedRows`
    (shared memory, no copy), so that ``model.pt`` maps raw images exactly as the rows were trained
    on. Call once, after the last evaluation on the cached rows; nothing to do without whitening."""
    import torch

    from veil.models.scattering import WhitenedRows

    if plan.whitener is None:
        return
    rules = [m for m in full.modules() if isinstance(m, WhitenedRows)]
    if len(rules) != 1:  # pragma: no cover - unit_rows_net builds exactly one
        raise RuntimeError(f"expected one WhitenedRows in the released model, found {len(rules)}")
    rules[0].set_whitener(torch.from_numpy(plan.whitener))


@dataclass
class Session:
    """The live objects of one process's training: the private model, its engine and optimizer, the
    hook-free copy that evaluates the released (averaged) weights, and the state a checkpoint keeps."""

    model: nn.Module
    full: nn.Module
    engine: PrivacyEngine
    optimizer: DPOptimizer
    loader: Any  # the engine's DP loader (physical chunks, with a last-chunk signal)
    criterion: nn.Module
    eval_model: nn.Module
    x_test: np.ndarray
    clip_check: Check
    fingerprint: torch.Tensor | None
    one_run: RunAudit | None
    ema: dict[str, torch.Tensor]
    history: list[dict[str, float]]
    applied: int
    resumed: bool
    augment: Any = None
    """``(x, y) -> (rows, labels)``: each example's K augmented copies (``--augment K``), or None."""
    drawn: int = 0
    """Examples the sampler drew in this process (for the sampling check; not stored)."""
    taken: int = 0
    """Logical steps taken in this process."""


class _Rows(tuple):
    """A batch already gathered by one tensor index (see :func:`_rows_dataset_type`)."""


def _rows_dataset_type() -> type:
    from torch.utils.data import TensorDataset

    class RowsDataset(TensorDataset):
        """Fetches a whole batch with one tensor index (torch's ``__getitems__`` hook) instead of one
        Python call per example: a Poisson batch of 10⁵ rows otherwise spends seconds in that loop."""

        def __getitems__(self, indices: list[int]) -> list[_Rows]:
            import torch

            idx = torch.as_tensor(indices, dtype=torch.long)
            return [_Rows(t[idx] for t in self.tensors)]

    return RowsDataset


def _rows_dataset(*tensors: Any) -> Any:
    return _rows_dataset_type()(*tensors)


def _collate_rows(items: list[Any]) -> Any:
    """A gathered batch passes as it is; single examples (the loader's template) collate as usual."""
    from torch.utils.data import default_collate

    if len(items) == 1 and isinstance(items[0], _Rows):
        return list(items[0])
    return default_collate(items)


def start(plan: RunPlan, run_dir: Path, ledger: Ledger, attach_audit: AttachAudit | None = None) -> Session:
    """Release (or restore) the preprocessing, build the private model and restore a checkpoint.

    ``attach_audit``: the job's audit hook (``veil train --audit`` passes
    :func:`veil.audit.hook.train_audit`), called right after ``make_private``; None: no audit."""
    from torch import nn

    cfg, data, device = plan.cfg, plan.data, plan.cfg.device
    ensure_preprocessing(plan, run_dir, ledger)
    whitening = plan.prepared.whitening
    net = build_net(cfg, data, cfg.seed, whitening=whitening)
    view, x_train, x_test = trainable_view(plan, net, device)
    ensure_whitening(plan, run_dir, ledger)
    if cfg.augment > 1:  # a last guard for every job (veil train refuses it before writing anything)
        from veil.augment.multiplicity import refuse_unsupported

        refuse_unsupported(cfg.augment, data.kind, data.input_shape, cfg.model, view.front is not None)
    criterion = nn.CrossEntropyLoss()
    clip_check = clipping_check(view.full, data, cfg.seed, criterion)
    engine = make_engine(cfg, cfg.seed)
    model, dp_optimizer, dp_loader = _make_private(plan, engine, view, x_train, criterion, ledger)
    one_run = None if attach_audit is None else attach_audit(cfg, model, dp_optimizer, engine, x_train)
    state = _restore(run_dir, ledger, cfg, model, dp_optimizer, engine)
    # The released weights: an exponential moving average of the DP iterates (post-processing, so
    # free of privacy cost), evaluated on a hook-free copy of the model.
    ema = {
        k: v.detach().clone() for k, v in (state["ema"] if state is not None else model.state_dict()).items()
    }
    eval_model = trainable_view(plan, build_net(cfg, data, cfg.seed, whitening=whitening), device)[0]
    return Session(
        model=model,
        full=eval_model.full,
        engine=engine,
        optimizer=dp_optimizer,
        loader=dp_loader,
        criterion=criterion,
        eval_model=eval_model.model,
        x_test=x_test,
        clip_check=clip_check,
        fingerprint=ckpt.front_fingerprint(net, data.input_shape),
        one_run=one_run,
        ema=ema,
        history=list(state["history"]) if state is not None else [],
        applied=int(state["applied"]) if state is not None else 0,
        resumed=state is not None,
        augment=_augmenter(cfg, data.input_shape) if cfg.augment > 1 else None,
    )


def _row_loader(plan: RunPlan, x_train: np.ndarray) -> Any:
    """The loader ``make_private`` turns into Poisson batches: the training rows in memory, or in the
    Parquet file with ``--stream`` (:mod:`veil.pipeline.streaming`)."""
    import torch
    from torch.utils.data import DataLoader

    cfg, data = plan.cfg, plan.data
    if cfg.stream:
        from veil.pipeline.streaming import StreamedDataset, rows_dataset

        assert isinstance(data, StreamedDataset)
        rows: Any = rows_dataset(data, _Rows)
    else:
        rows = _rows_dataset(torch.from_numpy(x_train), torch.from_numpy(data.y_train))
    return DataLoader(rows, batch_size=cfg.batch_size, collate_fn=_collate_rows)


def _make_private(
    plan: RunPlan,
    engine: PrivacyEngine,
    view: Trainable,
    x_train: np.ndarray,
    criterion: nn.Module,
    ledger: Ledger,
) -> tuple[nn.Module, DPOptimizer, Any]:
    """``make_private`` with the plan's σ and C, then the loop's options on the private objects
    (streamed windows, adaptive clipping, augmentation groups); refuses an engine whose per-step event
    differs from the one the ledger charges."""
    cfg, data = plan.cfg, plan.data
    assert cfg.max_grad_norm is not None and cfg.batch_size is not None
    model, dp_optimizer, dp_loader = engine.make_private(
        module=view.model,
        optimizer=make_optimizer(cfg, view.model),
        data_loader=_row_loader(plan, x_train),
        noise_multiplier=plan.steps.sigma,
        max_grad_norm=cfg.max_grad_norm,
        criterion=criterion,
        physical_batch_size=cfg.physical_batch_size,
        distributed=rank_and_world()[1] > 1,  # across ranks: veil.distributed
        population=plan.prepared.plan_size,  # a public size when the data's own count is private
        **_unit_arguments(cfg, data),
    )
    assert engine.plan is not None
    if cfg.stream:
        from veil.pipeline.streaming import install_window

        install_window(dp_loader, data)  # type: ignore[arg-type]
    if cfg.clip == "adaptive":
        from veil.clipping.adaptive import record_adaptive_clipping

        record_adaptive_clipping(dp_optimizer, cfg.target_quantile, ledger)
    if cfg.augment > 1:  # each example's K copies: one averaged gradient, clipped once
        dp_optimizer.clipper.group_size = cfg.augment
    if (
        engine.plan.event != plan.steps.step_event
        or engine.plan.steps_per_epoch != plan.steps.steps_per_epoch
    ):
        raise LedgerError(  # pragma: no cover - both come from accounting.calibrate.dpsgd_event
            "engine",
            engine.plan.event.to_json(),
            "the engine would account steps differently from the ledger",
            "report this as a bug",
        )
    return model, dp_optimizer, dp_loader


def _restore(
    run_dir: Path, ledger: Ledger, cfg: Any, model: nn.Module, optimizer: DPOptimizer, engine: PrivacyEngine
) -> dict[str, Any] | None:
    """The last checkpoint's state loaded into the private objects (None: a fresh run)."""
    state = ckpt.load_checkpoint(run_dir, ledger)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
        if cfg.clip == "adaptive" and "adaptive_clip" in state:  # C continues from where it was
            optimizer.adaptive.restore(state["adaptive_clip"])
    return state


def _records_drawn(s: Session, rows: int) -> int:
    """What the chunk drew of what Poisson sampling samples: rows, or units (labels ``0..U−1``)."""
    units = s.optimizer.clipper.unit_index
    if units is None:
        return rows
    return int(units.max()) + 1 if units.numel() else 0


def _unit_arguments(cfg: Any, data: Any) -> dict[str, Any]:
    """``make_private``'s privacy-unit arguments (:mod:`veil.units`): none for a row-level run."""
    if data.units_train is None:
        return {}
    return {"unit_ids": data.units_train, "max_rows_per_unit": cfg.max_rows_per_unit}


def _augmenter(cfg: Any, input_shape: tuple[int, ...]) -> Any:
    """``--augment K``: each example's K copies as consecutive rows, from a generator seeded for
    :attr:`Purpose.AUGMENT` (augmentation randomness is data-independent, so it may be seeded)."""
    import torch

    from veil.augment.multiplicity import default_pad, expand
    from veil.pipeline.seeds import Purpose, derive_seed

    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, Purpose.AUGMENT))
    pad = default_pad(input_shape)

    def rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return expand(x, y, cfg.augment, gen, flip=cfg.augment_flip, pad=pad)

    return rows


def update_ema(s: Session, decay: float | None) -> None:
    import torch

    d = min(decay or 0.0, (1 + s.applied) / (10 + s.applied))
    averaged = {name for name, _ in s.model.named_parameters()}
    with torch.no_grad():
        for k, v in s.model.state_dict().items():
            # Only parameters are averaged; buffers (e.g. ±inf clipping bounds) are copied, and
            # so is everything when averaging is off (0·inf would be NaN).
            if d > 0 and k in averaged and v.is_floating_point():
                s.ema[k].mul_(d).add_(v.detach(), alpha=1 - d)
            else:
                s.ema[k].copy_(v)


def evaluate_released(s: Session, plan: RunPlan) -> tuple[float, float]:
    """(test loss, test accuracy) of the released (averaged) weights: a diagnostic, not private."""
    s.eval_model.load_state_dict(s.ema)
    return evaluate(s.eval_model, s.x_test, plan.data.y_test, plan.cfg.device)


def checkpoint(s: Session, run_dir: Path, ledger: Ledger) -> None:
    ckpt.save_checkpoint(
        run_dir,
        ledger,
        {
            "format": ckpt.CKPT_FORMAT,
            "charged": ledger.steps,
            "applied": s.applied,
            "model": s.model.state_dict(),
            "ema": s.ema,
            "optimizer": s.optimizer.state_dict(),
            "engine": s.engine.state_dict(),
            "history": s.history,
            "front_fingerprint": s.fingerprint,
            **({"adaptive_clip": s.optimizer.adaptive.state_dict()} if s.optimizer.adaptive else {}),
        },
    )


def train_steps(
    s: Session,
    plan: RunPlan,
    run_dir: Path,
    ledger: Ledger,
    limit: int,
    curve: list[tuple[int, float]],
    bar: Any,
) -> None:
    """DP-SGD up to step ``limit``: each logical step is charged to the ledger (on disk) before its
    noisy update is computed; evaluation each epoch, checkpoints every ``checkpoint_every`` steps."""
    from veil.precision import autocast

    cfg, device, spe = plan.cfg, plan.cfg.device, plan.steps.steps_per_epoch
    step_dict = plan.steps.step_event.to_dict()
    forward = autocast(device, cfg.precision)  # bf16: the forward only; clipping and noise float32
    last_saved = ledger.steps if s.resumed else -1
    running: list[float] = []
    bar.update(
        step=ledger.steps, epoch=ledger.steps // spe, loss=None, epsilon=epsilon_at(curve, ledger.steps)
    )
    new_logical = True
    while ledger.steps < limit or not new_logical:
        for xb, yb in s.loader:
            if new_logical:
                if ledger.steps >= limit:
                    break
                # Charged and on disk before this step's noisy update is computed.
                ledger.append("step", step=ledger.steps + 1, event=step_dict)
            xr, yr = (xb, yb) if s.augment is None else s.augment(xb, yb)
            with forward:  # one context, re-entered each step (torch.autocast and nullcontext allow it)
                loss = s.criterion(s.model(xr.to(device)), yr.to(device))
            loss.backward()
            s.optimizer.step()
            s.optimizer.zero_grad()
            loss_value = float(loss.detach())
            if len(yb) and math.isfinite(loss_value):
                running.append(loss_value)
            s.drawn += _records_drawn(s, len(yb))
            new_logical = s.loader.signal.last_chunk
            if not new_logical:
                continue
            s.applied += 1
            s.taken += 1
            update_ema(s, cfg.ema_decay)
            k = ledger.steps
            if k % spe == 0 or k == limit:
                test_loss, test_acc = evaluate_released(s, plan)
                s.history.append(
                    {
                        "epoch": k / spe,
                        "step": float(k),
                        "epsilon": epsilon_at(curve, k),
                        "test_loss": test_loss,
                        "test_accuracy": test_acc,
                    }
                )
            if k % cfg.checkpoint_every == 0:
                checkpoint(s, run_dir, ledger)
                last_saved = k
            loss_avg = float(np.mean(running[-20:])) if running else None
            bar.update(step=k, epoch=math.ceil(k / spe), loss=loss_avg, epsilon=epsilon_at(curve, k))
    if last_saved != ledger.steps:
        checkpoint(s, run_dir, ledger)
