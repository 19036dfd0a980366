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
    # what every make_private installs
    guard = LoopLossGuard(model, reduction, rows=clipper.rows_in_flight) if guarded else None
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


class _Tokens(nn.Module):
    """A per-token classifier: each position's logits from that position's token alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _padded(records: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded with 0 and targets padded with -100 to the batch's longest record."""
    width = max(len(r) for r in records)
    x = torch.zeros(len(records), width, dtype=torch.long)
    y = torch.full((len(records), width), -100)
    for i, r in enumerate(records):
        x[i, : len(r)] = torch.tensor(r)
        y[i, : len(r)] = torch.tensor([t % 3 for t in r])
    return x, y


@pytest.mark.parametrize("flatten", [False, True], ids=["sequence-targets", "flattened"])
@pytest.mark.parametrize("via", ["forward", "submodule"])
def test_a_long_padded_record_does_not_rescale_the_others(flatten: bool, via: str) -> None:
    """Dynamic padding: one long record sets the batch's padded length. PyTorch's mean divides by
    the other records' targets too (the review measured 7.2 C); the guard's divisor is the rows
    the clipper multiplies back, so each record's term is its own tokens' sum. Also when the loss
    is taken on a submodule's output (the Lightning idiom), which the guard does not trace."""
    model, clip = _Tokens().double(), 0.5
    criterion = nn.CrossEntropyLoss()  # ignore_index -100

    def clipped(records: list[list[int]]) -> torch.Tensor:
        x, y = _padded(records)
        clipper = PerSampleClipper(model, clip, loss_reduction="mean")
        guard = LoopLossGuard(model, "mean", rows=clipper.rows_in_flight)
        try:
            out = model(x) if via == "forward" else model.net(x)
            out, y = (out.reshape(-1, 3), y.reshape(-1)) if flatten else (out.transpose(1, 2), y)
            criterion(out, y).backward()
            guard.check()
            clipper.accumulate()
            return torch.cat([t.flatten() for t in clipper.clipped_sum()])
        finally:
            clipper.remove()
            model.zero_grad()

    short = [[1, 2]] * 8
    moves = [
        float((clipped([*short, extra]) - clipped(short)).norm()) / clip
        for extra in ([4] + [11] * 39, [5, 6], [7])
    ]
    assert max(moves) <= 1 + 1e-9, moves


def test_a_subclass_with_its_own_forward_is_left_alone() -> None:
    """Only the base class's own mean is recomputed: a focal loss written as a subclass keeps its value."""

    class Focal(nn.CrossEntropyLoss):
        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(input, -1).gather(1, target[:, None]).squeeze(1)
            return (-((1 - p) ** 2) * torch.log(p)).mean()

    model = _model()
    x, y = _data(6)
    clipper = PerSampleClipper(model, CLIP, loss_reduction="mean")
    guard = LoopLossGuard(model, "mean", rows=clipper.rows_in_flight)
    try:
        out = model(x)
        got, want = Focal()(out, y).detach(), Focal.forward(Focal(), out, y).detach()
        assert float(got) == pytest.approx(float(want))
    finally:
        clipper.remove()
        del guard
