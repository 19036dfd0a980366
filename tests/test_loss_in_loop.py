"""A loss written in the training loop must not widen the sensitivity (veil.per_example_loss).

The engine watches every loss module applied to the private model's output: a weighted mean, a
reduction other than the declared one or an unreduced loss reduced in the loop is refused when the
loss is computed; a factor applied to the loss before ``backward()`` (a batch-dependent one such as
``len(batch) / B``) is refused at ``step()``. Each refusal comes before any noisy update is released:
the engine has charged no step and the parameters have not moved. Both the ``make_private`` path and
the Opacus-style one (``make_private_with_epsilon``, the criterion returned by ghost mode) are checked.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil import PrivacyEngine
from veil.errors import InvalidParameterError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WEIGHT = torch.tensor([1.0, 5.0, 0.2])


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(60, 5, generator=g), torch.randint(0, 3, (60,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=12)


def _make_private(path: str) -> tuple[PrivacyEngine, nn.Module, torch.optim.Optimizer, DataLoader]:
    engine = PrivacyEngine()
    model, optimizer, loader = _setup()
    if path == "make_private":
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
    elif path == "opacus_epsilon":  # the Opacus tutorial's call, the criterion kept in the loop
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            epochs=1,
            target_epsilon=3.0,
            target_delta=1e-3,
            max_grad_norm=1.0,
        )
    else:  # Opacus ghost mode: the engine hands back the criterion the loop uses
        model, optimizer, _criterion, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            criterion=nn.CrossEntropyLoss(),
            grad_sample_mode="ghost",
        )
    return engine, model, optimizer, loader


def _weighted_mean_module(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(weight=WEIGHT)(out, y)


def _weighted_mean_by_hand(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    terms = nn.CrossEntropyLoss(reduction="none")(out, y) * WEIGHT[y]
    return terms.sum() / WEIGHT[y].sum()


def _batch_factor(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out, y) * len(y) / 12.5  # 12.5: never 1, whatever the Poisson batch size


def _divided_by_batch_weight(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(reduction="sum")(out, y) / WEIGHT[y].sum()


def _sum_under_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(reduction="sum")(out, y)


PATHS = ["make_private", "opacus_epsilon", "opacus_ghost"]
WIDENING: list[Loss] = [
    _weighted_mean_module,
    _weighted_mean_by_hand,
    _batch_factor,
    _divided_by_batch_weight,
    _sum_under_mean,
]


@pytest.mark.parametrize("loss", WIDENING, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("path", PATHS)
def test_a_loss_that_widens_sensitivity_is_refused_before_any_release(path: str, loss: Loss) -> None:
    engine, model, optimizer, loader = _make_private(path)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidParameterError, match="loss") as info:
        for x, y in loader:
            optimizer.zero_grad()
            loss(model(x), y).backward()
            optimizer.step()
    assert "Fix:" in str(info.value)
    assert engine.steps == 0  # nothing charged, so nothing was released
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out, y)


def _functional_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _nll_on_log_softmax(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.NLLLoss()(torch.log_softmax(out, dim=1), y)


@pytest.mark.parametrize("loss", [_mean, _functional_mean, _nll_on_log_softmax], ids=lambda f: f.__name__)
@pytest.mark.parametrize("path", PATHS)
def test_an_ordinary_mean_loss_trains(path: str, loss: Loss) -> None:
    engine, model, optimizer, loader = _make_private(path)
    for x, y in loader:
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
    assert engine.steps == len(loader) == 5


def test_an_ordinary_sum_loss_trains_under_a_sum_reduction() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _setup()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=criterion,
    )
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 5


def test_a_loss_on_other_tensors_is_left_alone() -> None:
    """Loss modules that never see the private model's output (a probe, another network) pass."""
    engine, model, optimizer, loader = _make_private("make_private")
    for x, y in loader:
        optimizer.zero_grad()
        nn.CrossEntropyLoss(weight=WEIGHT)(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
        nn.CrossEntropyLoss()(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 5


def test_the_guard_keeps_no_graph_and_no_global_hook_alive() -> None:
    import gc

    from torch.nn.modules import module as torch_module

    gc.collect()  # earlier tests' optimizers (and their guards' hooks) are gone before counting
    hooks_before = len(torch_module._global_forward_hooks)
    engine, model, optimizer, loader = _make_private("make_private")
    assert len(torch_module._global_forward_hooks) == hooks_before + 1
    x = torch.randn(4, 5)
    for _ in range(40):  # forwards without a step (evaluation with grad enabled)
        model(x)
    assert len(optimizer.loss_guard._outputs) <= 16
    del engine, model, optimizer, loader
    gc.collect()
    assert len(torch_module._global_forward_hooks) == hooks_before
