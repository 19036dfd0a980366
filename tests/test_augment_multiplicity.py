"""Augmentation multiplicity: per-example averaged-then-clipped contributions, against a naive loop."""

from __future__ import annotations

import pytest
import torch

from veil.augment.multiplicity import averaged_clipped_sum
from veil.augment.ops import augment, random_flip, random_shift


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 10),
    )


def test_each_example_contributes_at_most_c_and_matches_a_naive_loop() -> None:
    model, gen = _model(), torch.Generator().manual_seed(1)
    b, k, c = 6, 4, 0.05
    x = torch.rand(b, 1, 8, 8)
    y = torch.randint(0, 10, (b,))
    views = torch.stack([augment(x, gen) for _ in range(k)], dim=1)  # [B, K, 1, 8, 8]
    summed, norms = averaged_clipped_sum(model, views, y, c)
    naive_total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(b):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(views[i]), y[i].repeat(k)).backward()  # mean over K
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
        assert torch.allclose(norm, norms[i], rtol=1e-4)
        contribution = {n: v * min(1.0, c / float(norm)) for n, v in g.items()}
        assert float(torch.sqrt(sum(v.pow(2).sum() for v in contribution.values()))) <= c * (1 + 1e-5)
        for n in naive_total:
            naive_total[n] += contribution[n]
    assert float(norms.min()) > c  # every example was clipped: the bound is exercised
    for n, v in summed.items():
        assert torch.allclose(v, naive_total[n], atol=1e-6)
    # Removing one example changes the sum by at most C (sensitivity unchanged by K).
    rest, _ = averaged_clipped_sum(model, views[1:], y[1:], c)
    diff = torch.sqrt(sum((summed[n] - rest[n]).pow(2).sum() for n in summed))
    assert float(diff) <= c * (1 + 1e-5)


def test_ops_are_shifts_and_flips() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).view(2, 1, 5, 5)
    assert torch.equal(random_shift(x, gen, pad=0), x)
    flipped = random_flip(x, torch.Generator().manual_seed(3))
    for i in range(2):
        assert torch.equal(flipped[i], x[i]) or torch.equal(flipped[i], x[i].flip(-1))
    shifted = random_shift(x, gen, pad=1)
    assert shifted.shape == x.shape
    # A shift keeps the centre pixel within one pixel of where it was.
    assert any(
        float(shifted[0, 0, 2, 2]) == float(x[0, 0, 2 + dy, 2 + dx]) for dy in (-1, 0, 1) for dx in (-1, 0, 1)
    )


# -- the clipper's grouped path (veil train --augment K) against a naive per-example loop ------------


class _Scale(torch.nn.Module):
    """A layer without a registered rule: the torch.func fallback, summed per group by the clipper."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _grouped_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(3)
    nn = torch.nn
    return {
        # conv (materialised at 6×6, ghost at 2×2 positions: see the test), grouped conv, GroupNorm,
        # a flat Linear (ghost: K·(d+p) < d·p) and the fallback rule
        "cnn": nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.Tanh(),
            nn.Conv2d(8, 8, 3, padding=1, groups=2),
            nn.Tanh(),
            nn.Conv2d(8, 16, 3, stride=2),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(64, 40),
            _Scale(40),
            nn.Tanh(),
            nn.Linear(40, 5),
        ).double(),
        # more output channels than patch rows: the conv's weight and bias from the patch matmul, per row,
        # then summed over each example's K rows
        "cnn_wide": nn.Sequential(
            nn.Conv2d(1, 12, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(12 * 36, 5)
        ).double(),
        # a sequence through Linear: the K copies become K·T positions
        "sequence": nn.Sequential(nn.Flatten(2), nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 5)).double(),
    }


def _sequence_head(out: torch.Tensor) -> torch.Tensor:
    return out.mean(dim=1) if out.dim() == 3 else out


def _naive(
    model: torch.nn.Module, views: torch.Tensor, y: torch.Tensor, c: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(∇ (1/K) Σ_k ℓ(view_ik)), one example at a time, and the unclipped norms."""
    params = [p for p in model.parameters()]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(views.shape[0]):
        k = views.shape[1]
        loss = torch.nn.functional.cross_entropy(_sequence_head(model(views[i])), y[i].repeat(k))
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        factor = min(1.0, c / float(norm))
        for t, g in zip(total, grads, strict=True):
            t += factor * g
    return total, torch.stack(norms)


def _grouped(
    model: torch.nn.Module, views: torch.Tensor, y: torch.Tensor, c: float, reduction: str = "mean"
) -> tuple[list[torch.Tensor], torch.Tensor]:
    from veil.clipping import PerSampleClipper

    b, k = views.shape[:2]
    clipper = PerSampleClipper(model, c, loss_reduction=reduction)  # type: ignore[arg-type]
    try:
        clipper.group_size = k
        rows = views.reshape(b * k, *views.shape[2:])
        out = _sequence_head(model(rows))
        loss = torch.nn.functional.cross_entropy(out, y.repeat_interleave(k), reduction=reduction)
        (loss / k if reduction == "sum" else loss).backward()
        norms = clipper.accumulate()
        return [s.clone() for s in clipper.clipped_sum()], norms
    finally:
        clipper.remove()


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = torch.sqrt(sum((x - y).pow(2).sum() for x, y in zip(a, b, strict=True)))
    den = torch.sqrt(sum(y.pow(2).sum() for y in b))
    return float(num / den)


def _inputs(name: str, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    if name.startswith("cnn"):
        x = torch.rand(b, 1, 6, 6, generator=gen, dtype=torch.float64)
        views = torch.stack([augment(x, gen, pad=1) for _ in range(k)], dim=1)
    else:
        views = torch.randn(b, k, 3, 2, 3, generator=gen, dtype=torch.float64)  # T = 3 positions of 6
    return views, torch.randint(0, 5, (b,), generator=gen)


@pytest.mark.parametrize("name", ["cnn", "cnn_wide", "sequence"])
@pytest.mark.parametrize("k", [1, 3])
def test_grouped_clipping_matches_a_naive_per_example_loop(name: str, k: int) -> None:
    from veil.clipping._linear_algebra import ghost_is_cheaper

    # the paths this exercises: conv 1 materialised, the stride-2 conv and the first Linear ghost
    assert not ghost_is_cheaper(k * 36, 9, 8) and ghost_is_cheaper(k * 4, 72, 16)
    assert ghost_is_cheaper(k, 64, 40)
    model = _grouped_models()[name]
    views, y = _inputs(name, 7, k)
    c = 0.05
    naive, naive_norms = _naive(model, views, y, c)
    grouped, norms = _grouped(model, views, y, c)
    assert norms.shape == (7,)
    assert torch.allclose(norms, naive_norms, rtol=1e-9)
    assert float(naive_norms.min()) > c  # every example clipped: the bound binds
    assert _close(grouped, naive) <= 1e-6


def test_grouped_clipping_with_a_summed_loss() -> None:
    model = _grouped_models()["cnn"]
    views, y = _inputs("cnn", 5, 4)
    naive, _ = _naive(model, views, y, 0.05)
    grouped, _ = _grouped(model, views, y, 0.05, reduction="sum")
    assert _close(grouped, naive) <= 1e-6


def test_one_added_example_moves_the_grouped_sum_by_at_most_c() -> None:
    """Sensitivity with K = 4 copies: adding one example (its 4 rows) moves Σ clip(ḡ_i) by ≤ C."""
    model = _grouped_models()["cnn"]
    views, y = _inputs("cnn", 9, 4)
    c = 0.05
    with_it, norms = _grouped(model, views, y, c)
    without, _ = _grouped(model, views[1:], y[1:], c)
    diff = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(with_it, without, strict=True))))
    assert float(norms[0]) > c  # the added example is clipped: its contribution has norm exactly C
    assert c * (1 - 1e-6) <= diff <= c * (1 + 1e-9)
    # Clipping each copy separately would let it move the sum by up to K·C: the grouped path does not.
    naive, _ = _naive(model, views, y, c)
    assert _close(with_it, naive) <= 1e-6


def test_rows_that_are_not_whole_groups_are_refused() -> None:
    from veil.clipping import PerSampleClipper
    from veil.errors import InvalidParameterError, ModelNotSupportedError

    model = torch.nn.Linear(4, 2)
    clipper = PerSampleClipper(model, 1.0)
    try:
        with pytest.raises(InvalidParameterError):
            clipper.group_size = 0
        clipper.group_size = 3
        with pytest.raises(ModelNotSupportedError):
            model(torch.randn(4, 4))
    finally:
        clipper.remove()
