"""The DP channel statistics of bench/fashion_scatter_levers.py: exact without noise, bounded
influence of one example (the sensitivity its accounting assumes), noise of the stated scale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fashion_scatter_levers.py"


def _levers():
    spec = importlib.util.spec_from_file_location("bench_fashion_scatter_levers", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _maps(n: int, scale: float, seed: int = 0) -> torch.Tensor:
    return scale * torch.rand(n, 81, 7, 7, generator=torch.Generator().manual_seed(seed))


def test_without_noise_small_examples_give_the_exact_channel_mean_and_variance():
    x = _maps(50, 0.01)  # per-example norm of (means, mean squares) well under the clip
    mean, var = _levers().dp_channel_stats(x, clip=1.0, sigma=0.0, generator=torch.Generator())
    d = x.double()
    torch.testing.assert_close(mean.double(), d.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-7)
    want = (d * d).mean(dim=(0, 2, 3)) - d.mean(dim=(0, 2, 3)) ** 2
    torch.testing.assert_close(var.double(), want, rtol=1e-4, atol=1e-8)


def test_one_example_moves_the_released_sums_by_at_most_the_clip():
    levers = _levers()
    x = _maps(40, 0.01)
    outlier = torch.full((1, 81, 7, 7), 50.0)  # far above the clip
    clip = 0.3
    g = torch.Generator()
    m0, v0 = levers.dp_channel_stats(x, clip=clip, sigma=0.0, generator=g)
    m1, v1 = levers.dp_channel_stats(torch.cat([x, outlier]), clip=clip, sigma=0.0, generator=g)
    # back to sums: mean·n and (var + mean²)·n
    s0 = torch.cat([m0.double() * 40, (v0.double() + m0.double() ** 2) * 40])
    s1 = torch.cat([m1.double() * 41, (v1.double() + m1.double() ** 2) * 41])
    assert float((s1 - s0).norm()) <= clip * (1 + 1e-4)
    assert float((s1 - s0).norm()) >= clip * 0.99  # the outlier is clipped to the bound, not dropped


def test_noise_on_the_released_mean_has_standard_deviation_sigma_clip_over_n():
    # 400 releases of the 81 mean coordinates: the sample std of the mean's noise is within 5% of
    # σ·clip/n with a false-failure rate far below 1e-6 (relative s.e. of a std over 32,400
    # draws ≈ 0.4%).
    levers = _levers()
    x = _maps(20, 0.01)
    n, clip, sigma = 20, 0.5, 3.0
    exact, _ = levers.dp_channel_stats(x, clip=clip, sigma=0.0, generator=torch.Generator())
    g = torch.Generator().manual_seed(7)
    noise = torch.stack(
        [levers.dp_channel_stats(x, clip=clip, sigma=sigma, generator=g)[0] - exact for _ in range(400)]
    )
    assert abs(float(noise.double().std()) / (sigma * clip / n) - 1) < 0.05


def test_flip_views_clip_each_examples_averaged_gradient_once_as_a_naive_loop_does():
    # --flip views: the preset's head (GroupNorm 27 + linear on 81×7×7 maps), each example's two
    # views as consecutive rows and clipper.group_size = 2. The clipped sum must equal
    # Σ_i clip_C(∇ mean(ℓ(view_i1), ℓ(view_i2))) computed one example at a time, and each
    # contribution must have norm ≤ C (sensitivity C, as without the mirror).
    from veil.clipping import PerSampleClipper

    torch.manual_seed(0)
    head = _levers().head("linear", 27).double()
    b, c = 5, 0.05
    views = _maps(2 * b, 1.0, seed=3).double().reshape(b, 2, 81, 7, 7)
    y = torch.randint(0, 10, (b,), generator=torch.Generator().manual_seed(4))
    params = list(head.parameters())
    naive = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(b):
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(head(views[i]), y[i].repeat(2)), params)
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        norms.append(norm)
        for t, g in zip(naive, grads, strict=True):
            t += min(1.0, c / norm) * g
    assert min(norms) > c  # every example is clipped: the bound is exercised
    clipper = PerSampleClipper(head, c)
    try:
        clipper.group_size = 2
        loss = torch.nn.functional.cross_entropy(head(views.flatten(0, 1)), y.repeat_interleave(2))
        loss.backward()
        got_norms = clipper.accumulate()
        got = [s.clone() for s in clipper.clipped_sum()]
    finally:
        clipper.remove()
    want_norms = torch.tensor(norms, dtype=torch.float64)
    torch.testing.assert_close(got_norms.double(), want_norms, rtol=1e-6, atol=0)
    for g, want in zip(got, naive, strict=True):
        torch.testing.assert_close(g.double(), want, rtol=1e-6, atol=1e-10)


def test_accuracy_of_paired_views_averages_their_logits():
    levers = _levers()
    lin = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    # view 1 says class 0 by 1, view 2 says class 1 by 3: the mean of the logits says class 1
    x = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]]).reshape(1, 2, 3, 1, 1)
    model = torch.nn.Sequential(torch.nn.Flatten(), lin)
    assert levers.accuracy(model, x, torch.tensor([1])) == 1.0
    assert levers.accuracy(model, x[:, 0], torch.tensor([1])) == 0.0
