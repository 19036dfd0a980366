"""Augmentation multiplicity: per-example averaged-then-clipped contributions, against a naive loop."""

from __future__ import annotations

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
