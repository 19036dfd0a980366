"""The non-private baseline of ``veil train``: the same model and split, trained without privacy until
its own validation loss stops improving, or until a step cap, which the report then states.

Not private and not covered by the guarantee: it trains on the private training split, and its test
accuracy is a non-private release about the held-out rows (the report's ``non_private`` section).

Stopping rule. A tenth of the training split is held out for validation, each row by a keyed hash of
its own content (:func:`veil.data.held_out`, key from the baseline's seed). A model whose only trained
layer is a final linear one (logistic regression, or a linear head on a fixed front) has a convex loss:
it is fitted by full-batch L-BFGS (:data:`LBFGS_ITERATIONS` iterations a round), which converges where
small-batch Adam keeps oscillating. Any other model takes Adam (1e-3 for the CNN, 1e-2 otherwise;
batches of 32, or 128 above 10 000 examples), a round being an epoch. After each round the weights with
the lowest validation loss so far are kept, and training stops once it has not improved by 0.1 % for
:data:`PATIENCE` rounds (:data:`PATIENCE_CONVEX` for L-BFGS): ``converged``. The cost stays bounded:
at most :data:`MAX_EPOCHS` rounds and ``max(STEPS_PER_DP_STEP × planned DP steps, MIN_STEPS)``
optimizer steps; stopping there is ``capped``, and the report says that the utility cost of privacy
may then be understated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from veil.pipeline.model import build_net, evaluate
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from veil.pipeline.loop import RunPlan

__all__ = ["MAX_EPOCHS", "MIN_STEPS", "PATIENCE", "STEPS_PER_DP_STEP", "BaselineResult", "train_baseline"]

PATIENCE = 5
"""Adam rounds (epochs) without a 0.1 % lower validation loss after which the baseline has converged."""
PATIENCE_CONVEX = 2
"""The same for L-BFGS rounds on a convex model, each of which does far more than an epoch of Adam."""
MAX_EPOCHS = 200
STEPS_PER_DP_STEP = 10
MIN_STEPS = 100
"""The step cap is ``max(STEPS_PER_DP_STEP × planned DP steps, MIN_STEPS)``: the baseline's cost follows
the DP run's (a short DP run on a large CNN gets a capped baseline, and its report says so)."""
VALIDATION_FRACTION = 0.1
LBFGS_ITERATIONS = 20
"""L-BFGS iterations per round for a convex (linear) model; each counts as a step of the cap."""


@dataclass
class BaselineResult:
    test_accuracy: float
    history: list[dict[str, float]] = field(default_factory=list)
    """Per-epoch test loss and accuracy (the curves plot)."""
    stopped: str = ""
    """How training ended: ``converged ...`` or ``capped ...`` (said in the report)."""


def train_baseline(plan: RunPlan, device: str) -> BaselineResult:
    """Train the non-private baseline of ``plan`` (module docstring) and return its test accuracy."""
    import torch

    from veil.data import held_out
    from veil.pipeline.loop import trainable_view

    cfg, data = plan.cfg, plan.data
    seed = derive_seed(cfg.seed, Purpose.BASELINE)
    view, x_train, x_test = trainable_view(plan, build_net(cfg, data, cfg.seed), device)
    model = view.model
    valid = held_out(data.x_train, data.y_train, VALIDATION_FRACTION, seed, data.classes)
    if valid.all() or not valid.any():  # too few rows to hold any out: validate on the training rows
        valid = np.ones(len(valid), dtype=bool)
        fit = valid
    else:
        fit = ~valid
    cap = max(STEPS_PER_DP_STEP * plan.steps.steps_planned, MIN_STEPS)
    convex = _convex(model)
    rows = torch.from_numpy(np.flatnonzero(fit))
    if convex:  # full-batch L-BFGS: the fitting rows gathered once
        xs, ys = torch.from_numpy(x_train[fit]).to(device), torch.from_numpy(data.y_train[fit]).to(device)
        one_round = _lbfgs_round(model, xs, ys)
    else:  # small batches gathered from the training rows as they are drawn (no copy of the split)
        xs, ys = torch.from_numpy(x_train).to(device), torch.from_numpy(data.y_train).to(device)
        one_round = _adam_round(plan, model, xs, ys, rows.to(device), seed)
    x_valid, y_valid = x_train[valid], data.y_train[valid]
    patience = PATIENCE_CONVEX if convex else PATIENCE
    best_loss, best_state, since, done = float("inf"), copy.deepcopy(model.state_dict()), 0, 0
    history: list[dict[str, float]] = []
    stopped = f"capped at {MAX_EPOCHS} rounds while the validation loss still fell"
    for epoch in range(1, MAX_EPOCHS + 1):
        done += one_round(cap - done)
        loss, acc = evaluate(model, x_test, data.y_test, device)
        history.append({"epoch": float(epoch), "test_loss": loss, "test_accuracy": acc})
        val_loss, _ = evaluate(model, x_valid, y_valid, device)
        if val_loss < best_loss * (1 - 1e-3):
            best_loss, best_state, since = val_loss, copy.deepcopy(model.state_dict()), 0
        else:
            since += 1
        if since >= patience:
            stopped = f"converged: validation loss flat for {patience} rounds (round {epoch})"
            break
        if done >= cap:
            stopped = (
                f"capped at {cap} steps (epoch {epoch}) while the validation loss still fell: the "
                "utility cost of privacy may be understated"
            )
            break
    model.load_state_dict(best_state)
    _, accuracy = evaluate(model, x_test, data.y_test, device)
    return BaselineResult(accuracy, history, stopped)


def _convex(model: nn.Module) -> bool:
    """Whether the only layer with trained parameters is a final ``nn.Linear`` (a convex loss)."""
    from torch import nn

    leaves = [m for m in model.modules() if not list(m.children())]
    trained = [m for m in leaves if any(p.requires_grad for p in m.parameters())]
    return len(trained) == 1 and isinstance(trained[0], nn.Linear) and leaves[-1] is trained[0]


def _lbfgs_round(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> Callable[[int], int]:
    """One round of full-batch L-BFGS: at most :data:`LBFGS_ITERATIONS` iterations (fewer near the cap)."""
    import torch

    def one_round(left: int) -> int:
        iterations = max(1, min(LBFGS_ITERATIONS, left))
        opt = torch.optim.LBFGS(
            [p for p in model.parameters() if p.requires_grad],
            max_iter=iterations,
            history_size=10,
            line_search_fn="strong_wolfe",
        )

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs), ys)
            loss.backward()
            return loss

        opt.step(closure)
        return iterations

    return one_round


def _adam_round(
    plan: RunPlan, model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor, seed: int
) -> Callable[[int], int]:
    """One epoch of Adam on shuffled small batches of ``xs[rows]`` (stopping at the cap)."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-3 if plan.model_name == "cnn" else 1e-2)
    gen = torch.Generator().manual_seed(seed)
    batch = 32 if plan.data.n_train < 10_000 else 128

    def one_round(left: int) -> int:
        done = 0
        order = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(rows), batch):
            if done >= left:
                break
            idx = rows[order[start : start + batch].to(rows.device)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            done += 1
        return done

    return one_round
