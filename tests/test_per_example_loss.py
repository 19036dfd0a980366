"""The loss contract: with the real clipper, adding one example moves the clipped sum by ≤ C, or the
engine refuses the criterion. Deterministic (fixed seeds, float64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.clipping import PerSampleClipper
from veil.engine import PrivacyEngine
from veil.errors import InvalidParameterError
from veil.per_example_loss import LoopLossGuard

CLIP = 1.0
WEIGHT = torch.tensor([1.0, 0.5, 8.0], dtype=torch.float64)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(n: int = 24, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64) * scale  # small gradients: mostly unclipped
    y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def _clipped_sum(
    model: nn.Module,
    criterion: nn.Module,
    reduction: str,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float = CLIP,
    guarded: bool = False,
) -> torch.Tensor:
    clipper = PerSampleClipper(model, clip, loss_reduction=reduction)  # type: ignore[arg-type]
    guard = LoopLossGuard(model, reduction) if guarded else None  # what every make_private installs
    try:
        criterion(model(x), y).backward()
        if guard is not None:
            guard.check()
        clipper.accumulate()
        return torch.cat([s.flatten() for s in clipper.clipped_sum()])
    finally:
        clipper.remove()
        del guard


def _largest_move(
    criterion: nn.Module,
    reduction: str,
    *,
    ignore: int | None = None,
    clip: float = CLIP,
    guarded: bool = False,
) -> float:
    """max over added examples (each class, and an ignored target) of ‖sum(D ∪ {z}) − sum(D)‖ / C."""
    model = _model()
    x, y = _data()
    if ignore is not None:
        y = y.clone()
        y[::2] = ignore  # half the rows ignored: the mean's divisor is far from the batch size
    base = _clipped_sum(model, criterion, reduction, x, y, clip, guarded)
    moves = []
    labels = [0, 1, 2] + ([ignore] if ignore is not None else [])
    for label in labels:
        for k in range(3):
            z = torch.randn(1, 5, generator=torch.Generator().manual_seed(10 + k), dtype=torch.float64)
            xs, ys = torch.cat([x, z]), torch.cat([y, torch.tensor([label])])
            moves.append(
                float((_clipped_sum(model, criterion, reduction, xs, ys, clip, guarded) - base).norm()) / clip
            )
    return max(moves)


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum"),
        nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum", label_smoothing=0.1),
        nn.CrossEntropyLoss(reduction="mean", label_smoothing=0.2),
        nn.CrossEntropyLoss(reduction="mean"),
    ],
    ids=["weighted-sum", "weighted-smoothed-sum", "smoothed-mean", "plain-mean"],
)
def test_adding_one_example_moves_the_clipped_sum_by_at_most_c(criterion: nn.Module) -> None:
    assert _largest_move(criterion, criterion.reduction) <= CLIP * (1 + 1e-9)


def test_ignored_targets_with_a_sum_add_nothing() -> None:
    criterion = nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum", ignore_index=-1)
    assert _largest_move(criterion, "sum", ignore=-1) <= CLIP * (1 + 1e-9)


@pytest.mark.parametrize("ignore", [False, True], ids=["weighted-mean", "ignored-target-mean"])
def test_a_batch_dependent_divisor_breaks_the_bound(ignore: bool) -> None:
    """Why the engine refuses a weighted mean and fixes the ignored-target mean's divisor: without
    that, the same measurement fails (so the tests above and below can fail)."""
    if ignore:
        # C large enough that the other examples are not clipped, so their rescaling shows
        assert _largest_move(nn.CrossEntropyLoss(ignore_index=-1), "mean", ignore=-1, clip=4.0) > 1.0
    else:
        assert _largest_move(nn.CrossEntropyLoss(weight=WEIGHT), "mean") > 2 * CLIP


def _make_private(criterion: nn.Module, y: torch.Tensor | None = None, **kw: Any) -> Any:
    model = _model()
    x, labels = _data()
    loader = DataLoader(TensorDataset(x, labels if y is None else y), batch_size=6)
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=CLIP,
        criterion=criterion,
        **kw,
    )
    return engine, model, out


def test_a_weighted_mean_is_refused_before_anything_changes() -> None:
    model = _model()
    x, y = _data()
    engine = PrivacyEngine()
    with pytest.raises(InvalidParameterError, match="reduction='sum'") as info:
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            criterion=nn.CrossEntropyLoss(weight=WEIGHT),
        )
    assert "Fix:" in str(info.value) and engine.plan is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_weighted_sum_trains() -> None:
    criterion = nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum")
    engine, _, (m, optimizer, loader) = _make_private(criterion)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(m(x), y).backward()
        optimizer.step()
    assert engine.steps == 4


def test_an_ignored_target_with_a_mean_adds_nothing_under_the_guard() -> None:
    """The guard's fixed divisor: adding an example (ignored or not) moves the clipped sum by ≤ C,
    where PyTorch's own mean (divisor: the targets not ignored) moves it by more (test above)."""
    criterion = nn.CrossEntropyLoss(ignore_index=-1)
    assert _largest_move(criterion, "mean", ignore=-1, clip=4.0, guarded=True) <= 1 + 1e-9


@pytest.mark.parametrize("clip", [CLIP, 50.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_fixed_divisor_mean_equals_a_naive_per_example_loop(smoothing: float, clip: float) -> None:
    """Clipped sum under the guard = Σ over the targets not ignored of clip(∇ℓ_i), ℓ_i computed alone."""
    model = _model()
    x, y = _data(12)
    y = y.clone()
    y[[1, 4, 5]] = 2
    criterion = nn.CrossEntropyLoss(ignore_index=2, label_smoothing=smoothing)
    got = _clipped_sum(model, criterion, "mean", x, y, clip, guarded=True)
    want = torch.zeros_like(got)
    for i in range(len(x)):
        if int(y[i]) == 2:
            continue
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], label_smoothing=smoothing).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        want += g * min(1.0, clip / float(g.norm()))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_an_ignored_target_with_a_mean_trains_and_no_batch_is_refused() -> None:
    """No refusal on a target's value after reading: every batch trains, ignored rows add nothing."""
    criterion = nn.CrossEntropyLoss(ignore_index=2)
    _, y = _data()
    y = y.clone()
    y[::2] = 2  # the template row included
    engine, _, (m, optimizer, loader) = _make_private(criterion, y=y)
    for x, target in loader:
        optimizer.zero_grad()
        criterion(m(x), target).backward()
        optimizer.step()
    assert engine.steps == 4
    everything_ignored = criterion(m(torch.zeros(3, 5, dtype=torch.float64)), torch.full((3,), 2))
    assert float(everything_ignored.detach()) == 0.0  # PyTorch's own mean is NaN here
