"""Adaptive clipping: the clip converges to the target quantile; the combined step costs exactly σ."""

from __future__ import annotations

import numpy as np
import pytest

from veil.accounting.calibrate import dpsgd_event, epsilon_of
from veil.accounting.events import SelfComposed
from veil.clipping.adaptive import AdaptiveClip, gradient_noise, step_event
from veil.errors import InvalidParameterError


@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.8])
def test_clip_converges_to_the_target_quantile(quantile: float) -> None:
    """Log-normal synthetic norms, Poisson batches of ~256, count noise B/20 (seeded: deterministic)."""
    rng = np.random.default_rng(7)
    population = rng.lognormal(mean=0.5, sigma=0.8, size=20000)
    state = AdaptiveClip(clip=0.05, target_quantile=quantile, count_std=256 / 20, expected_batch_size=256)
    history = []
    for _ in range(600):
        batch = population[rng.random(population.size) < 256 / population.size]
        state.update(batch, rng.normal(0, state.count_std))
        history.append(state.clip)
    reached = np.mean(population <= np.median(history[-200:]))
    assert abs(reached - quantile) < 0.03


def test_gradient_and_count_together_cost_the_planned_sigma() -> None:
    sigma, count_std, q = 1.2, 12.8, 0.05
    sg = gradient_noise(sigma, count_std)
    assert sg > sigma
    event = step_event(q, sg, count_std)
    assert event.event.noise_multiplier == pytest.approx(sigma, rel=1e-12)  # type: ignore[attr-defined]
    eps_adaptive = epsilon_of([SelfComposed(event, 500)], 1e-5, "rdp")
    eps_fixed = epsilon_of([SelfComposed(dpsgd_event(q, sigma), 500)], 1e-5, "rdp")
    assert eps_adaptive == pytest.approx(eps_fixed, rel=1e-9)
    # Without sampling the joint release is a plain Gaussian: RDP α/2σ_g² + α/2(2σ_b)² = α/2σ².
    assert step_event(1.0, sg, count_std).noise_multiplier == pytest.approx(sigma, rel=1e-12)  # type: ignore[attr-defined]


def test_too_little_count_noise_is_refused() -> None:
    with pytest.raises(InvalidParameterError):
        gradient_noise(2.0, 0.9)
    with pytest.raises(InvalidParameterError):
        AdaptiveClip(clip=1.0, target_quantile=1.0, count_std=10, expected_batch_size=100)
