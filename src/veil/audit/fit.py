"""Training for an audit, through veil's pipeline: the same data preparation, presets, preprocessing,
model zoo, optimizer and :class:`~veil.PrivacyEngine` as ``veil train``, with per-record weights.

What differs from ``veil train`` (and why). Input canaries make the dataset N + m records, an
excluded canary staying as a zero-weight record, so the sampling rate q = B/(N + m) does not depend
on the canary bits; the loss is therefore the weighted sum of per-example losses
(``loss_reduction="sum"``; the per-example clipped gradients are the same as with a mean). No
ledger, checkpoints or budget stop: the accountant's ε for the steps actually taken is the promise
the audit is compared with (:func:`theoretical_epsilon`; None for σ = 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.calibrate import epsilon_of, with_steps
from veil.config import TrainConfig
from veil.pipeline.budget import plan_steps
from veil.pipeline.data import Prepared, UsesPrepared, prepare, release_preprocessing
from veil.pipeline.model import assemble, build_net, make_engine, make_optimizer, trainable

if TYPE_CHECKING:
    from torch import nn

    from veil.accounting.events import PrivacyEvent
    from veil.engine import PrivacyEngine
    from veil.optimizer import DPOptimizer

__all__ = ["Fit", "Setup", "fit", "make_model", "prepare_audit", "sigma_for", "theoretical_epsilon"]


@dataclass
class Setup(UsesPrepared):
    """The audited run's checked inputs (:class:`~veil.pipeline.data.Prepared`) and what it spent."""

    prepared: Prepared
    pre_events: list[PrivacyEvent]
    private: bool
    preprocess_state: dict[str, Any] | None = None
    """The released preprocessing statistic of a finished run (``--run``): shadows reuse it."""


@dataclass
class Fit:
    model: nn.Module
    engine: PrivacyEngine
    optimizer: DPOptimizer
    steps: int
    seconds: float


def prepare_audit(cfg: TrainConfig, private: bool, *, run_preprocessing: bool = True) -> Setup:
    """Prepare the data as ``veil train`` does and (unless told not to) release the DP preprocessing."""
    prepared = prepare(cfg, private=private)
    pre: list[PrivacyEvent] = []
    if prepared.prep.event is not None and run_preprocessing:
        release_preprocessing(prepared)
        pre.append(prepared.prep.event)
    return Setup(prepared, pre, private)


def make_model(setup: Setup, seed: int) -> nn.Module:
    """The whole model (preprocessing layer, then the network initialised from ``seed``)."""
    data = setup.data
    model = assemble(setup.prepared.prep, data.input_shape, build_net(setup.cfg, data, seed))
    if setup.preprocess_state is not None:
        model.get_submodule("preprocess").load_state_dict(setup.preprocess_state, strict=False)
    return model.to(setup.cfg.device)


def sigma_for(setup: Setup, n_records: int) -> float:
    """σ: 0 (non-private), the given one, or calibrated so the planned run fits the target ε."""
    return plan_steps(setup.cfg, n_records, setup.pre_events, private=setup.private).sigma


def fit(
    setup: Setup,
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    *,
    sigma: float,
    seed: int,
    before: Callable[[nn.Module, DPOptimizer, PrivacyEngine, np.ndarray], None] | None = None,
) -> Fit:
    """DP-SGD on ``(x, y)`` with per-record weights ``w`` (0 = a present but inert record).

    A model with a fixed front (:class:`veil.models.FixedFeaturesThenHead`) is trained as ``veil
    train`` trains it: the front maps every record once (a fixed per-example map, no privacy cost)
    and DP-SGD trains the head on the features. ``before(trained, optimizer, engine, inputs)`` runs
    after ``make_private``, with ``inputs`` the records as ``trained`` takes them. The returned
    model is the whole model (raw inputs in)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from veil.pipeline.public_inputs import refuse_mixing_on_public_inputs

    cfg = setup.cfg
    assert cfg.batch_size is not None and cfg.epochs is not None and cfg.max_grad_norm is not None
    device = cfg.device
    model = make_model(setup, seed)
    t0 = time.perf_counter()  # the fixed features count as training time
    view = trainable(model)
    if view.front is not None:  # make_private sees only the head: probe the whole model first
        refuse_mixing_on_public_inputs(model, setup.data, seed)
    inputs = view.inputs(x, device)
    engine = make_engine(cfg, seed)
    dataset = TensorDataset(
        torch.as_tensor(inputs), torch.as_tensor(y, dtype=torch.long), torch.as_tensor(w, dtype=torch.float32)
    )
    loader = DataLoader(dataset, batch_size=min(cfg.batch_size, len(dataset)))
    trained, dp_optimizer, dp_loader = engine.make_private(
        module=view.model,
        optimizer=make_optimizer(cfg, view.model),
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
    return Fit(model, engine, dp_optimizer, engine.steps, time.perf_counter() - t0)


def theoretical_epsilon(setup: Setup, fit: Fit) -> float | None:
    """The accountant's ε for what the run spent (preprocessing and the steps taken); None for σ = 0."""
    if not setup.private:
        return None
    assert fit.engine.plan is not None
    events = with_steps(setup.pre_events, fit.engine.plan.event, fit.steps)
    return epsilon_of(events, setup.cfg.delta, setup.cfg.accountant) if events else 0.0
