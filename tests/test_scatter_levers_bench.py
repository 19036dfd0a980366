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
