"""The engine's modules through the facade: a caller's own RankContext, and the shuffled loader's σ.

``make_private(distributed=context)``: a run across ranks described by a caller's own RankContext.

The engine knows a multi-process run only through :class:`veil.engine.ranks.RankContext`; a caller
above the engine may build one and pass it in. These tests pass a recording context (one process, no
process group) and check that the engine trains the context's module, runs every check and build
step of the context in make_private's order, draws its batches from the context's sampler and wraps
the optimizer with the context's optimizer class; and that a refusal by the context leaves the
engine untouched. A plain bool still resolves the torch.distributed setup (tests/test_distributed*.py).
The last test checks :func:`veil.engine.planning.noise_multiplier` for the shuffled loader against an
independent composition of its per-step events.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.engine import PrivacyEngine
from veil.engine.ranks import resolve_ranks
from veil.errors import ConfigError
from veil.optimizer import DPOptimizer
from veil.plan import PrivacyPlan
from veil.sampling import PoissonBatchSampler


class _Recording:
    """A one-rank context that records what the engine asks of it."""

    rank, world_size = 0, 1

    def __init__(self, module: nn.Module, refuse_plan: bool = False) -> None:
        self.module = module
        self.calls: list[str] = []
        self.refuse_plan = refuse_plan
        self.plan: PrivacyPlan | None = None

    def check_sampling(self, sampling: str) -> None:
        self.calls.append(f"check_sampling:{sampling}")

    def check_loader(self, data_loader: DataLoader) -> None:
        self.calls.append("check_loader")

    def agree(self, plan: PrivacyPlan) -> None:
        self.calls.append("agree")
        self.plan = plan
        if self.refuse_plan:
            raise ConfigError("distributed plan", "rank 1 differs", "ranks disagree", "fix rank 1")

    def broadcast_parameters(self) -> None:
        self.calls.append("broadcast_parameters")

    def sampler(self, dataset_size: int, sampling_rate: float, steps_per_epoch: int, rng: Any) -> Any:
        self.calls.append(f"sampler:{dataset_size}:{sampling_rate}:{steps_per_epoch}")
        return PoissonBatchSampler(dataset_size, sampling_rate, steps_per_epoch, rng)

    @property
    def optimizer_class(self) -> Any:
        self.calls.append("optimizer_class")
        return DPOptimizer

    def guard_wrapper(self) -> None:
        self.calls.append("guard_wrapper")


def _setup() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    outer, inner = nn.Sequential(nn.Linear(4, 2)), nn.Linear(4, 2)
    data = TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))
    return outer, inner, torch.optim.SGD(inner.parameters(), lr=0.1), DataLoader(data, batch_size=5)


def test_a_context_passed_in_is_used_as_given() -> None:
    outer, inner, opt, loader = _setup()
    ranks = _Recording(inner)
    assert resolve_ranks(outer, ranks) is ranks
    assert ranks.calls == []  # resolving runs nothing of the context
    engine = PrivacyEngine(seed=0, reproducible=True)
    model, optimizer, private_loader = engine.make_private(
        module=outer,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        distributed=ranks,
    )
    assert model is inner  # the context's module is the one trained, not the one passed
    assert ranks.calls == [
        "check_sampling:poisson",
        "check_loader",
        "agree",
        "broadcast_parameters",
        "sampler:20:0.25:4",
        "optimizer_class",
        "guard_wrapper",
    ]
    assert ranks.plan == engine.plan and engine.distributed is ranks
    assert type(optimizer) is DPOptimizer
    for x, y in private_loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 4


def test_a_context_that_refuses_leaves_the_engine_untouched() -> None:
    outer, inner, opt, loader = _setup()
    engine = PrivacyEngine(seed=0, reproducible=True)
    ranks = _Recording(inner, refuse_plan=True)
    with pytest.raises(ConfigError, match="ranks disagree"):
        engine.make_private(
            module=outer,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            distributed=ranks,
        )
    assert ranks.calls[-1] == "agree" and engine.plan is None and engine.distributed is None


def test_one_process_needs_no_context_and_anything_else_is_refused() -> None:
    outer, _, _, _ = _setup()
    assert resolve_ranks(outer, None) is None and resolve_ranks(outer, False) is None
    with pytest.raises(ConfigError, match="explicit"):
        resolve_ranks(outer, "yes")  # type: ignore[arg-type]


def test_a_shuffled_run_calibrated_to_a_target_meets_it_at_sensitivity_2c() -> None:
    """σ calibrated for the opt-in shuffled loader: each step is Gaussian(σ/2) (replacement, 2C), so
    the composed ε of those steps (an independent composition, not the engine's accountant) meets the
    target and is close to it; σ calibrated as if the sensitivity were C would exceed it."""
    from veil.accounting.calibrate import epsilon_of
    from veil.accounting.events import Gaussian

    _, inner, opt, loader = _setup()
    engine = PrivacyEngine()
    engine.make_private(
        module=inner, optimizer=opt, data_loader=loader, max_grad_norm=1.0, target_epsilon=2.0,
        target_delta=1e-3, epochs=3, poisson_sampling=False, allow_non_poisson=True,
    )  # fmt: skip
    sigma, steps = engine.noise_multiplier, 3 * 4
    assert sigma is not None
    epsilon = epsilon_of([Gaussian(sigma / 2)] * steps, 1e-3)
    assert 1.9 <= epsilon <= 2.0
