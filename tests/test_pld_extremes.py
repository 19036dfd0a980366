"""PLD at extreme noise: tiny σ / Laplace scales and huge ε, against closed forms and dp-accounting.

References: the exact ε(δ) of a composition of k Gaussian mechanisms (a Gaussian with μ = √k/σ,
Balle & Wang 2018), pure ε = k/b for Laplace, and Google's dp-accounting where it can compute.
"""

from __future__ import annotations

import json
import math

import pytest
from scipy import optimize, special

from veil.accounting.events import Gaussian, Laplace
from veil.accounting.pld import PLDAccountant, _out_of_range_epsilon

DELTA = 1e-5


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε(δ) of the Gaussian mechanism with μ = sensitivity/σ (log domain: no overflow)."""

    def gap(e: float) -> float:
        return float(
            special.ndtr(-e / mu + mu / 2) - math.exp(e + special.log_ndtr(-e / mu - mu / 2)) - delta
        )

    return float(optimize.brentq(gap, 0.0, mu * mu + 50 * mu))


def _pld(event: object, count: int) -> PLDAccountant:
    acc = PLDAccountant()
    acc.compose(event, count)  # type: ignore[arg-type]
    return acc


@pytest.mark.parametrize(("sigma", "steps"), [(0.1, 3), (0.05, 5)])
def test_tiny_sigma_matches_the_exact_gaussian(sigma: float, steps: int) -> None:
    """ε in the hundreds (the add direction at q = 1 used to lose all its mass here and crash)."""
    exact = _gaussian_epsilon(math.sqrt(steps) / sigma, DELTA)
    got = _pld(Gaussian(sigma), steps).epsilon(DELTA)
    assert exact <= got <= exact * (1 + 1e-6) + 1e-6  # pessimistic and tight
    if sigma == 0.1:  # dp-accounting (coarser grid: its default one is slow at ε in the hundreds)
        from dp_accounting import dp_event, pld

        ref = pld.PLDAccountant(value_discretization_interval=1e-2)
        ref.compose(dp_event.GaussianDpEvent(sigma), steps)
        assert got == pytest.approx(ref.get_epsilon(DELTA), rel=2e-3)


def test_the_add_direction_keeps_its_probability_mass() -> None:
    acc = _pld(Gaussian(0.1), 3)
    for direction in ("remove", "add"):
        comp = acc._composition(direction)  # type: ignore[arg-type]
        assert float(comp.probs.sum()) + comp.constant == pytest.approx(1.0, abs=1e-9)


def test_tiny_laplace_scale_matches_pure_dp_and_dp_accounting() -> None:
    got = _pld(Laplace(0.02), 3).epsilon(DELTA)
    assert got == pytest.approx(150.0, rel=1e-5) and got <= 150.0 * (1 + 1e-5)
    from dp_accounting import dp_event, pld

    ref = pld.PLDAccountant(value_discretization_interval=1e-2)
    ref.compose(dp_event.LaplaceDpEvent(0.02), 3)
    assert got == pytest.approx(ref.get_epsilon(DELTA), rel=1e-3)


@pytest.mark.parametrize(
    ("event", "steps"),
    [(Gaussian(0.01), 2)],
)
def test_beyond_the_grid_epsilon_is_finite_and_sound(event: object, steps: int) -> None:
    """Per-step losses > 600 nats: ∞ was reported (or a crash); now a finite upper bound."""
    acc = _pld(event, steps)
    got = acc.epsilon(DELTA)
    assert math.isfinite(got)
    assert got == _out_of_range_epsilon(acc._counts, DELTA)
    if isinstance(event, Gaussian):  # never below the exact value: the bound is sound
        assert got >= _gaussian_epsilon(math.sqrt(steps) / event.noise_multiplier, DELTA)
    if isinstance(event, Laplace):
        assert got == pytest.approx(steps / event.noise_multiplier)


def test_the_epsilon_command_prints_a_finite_number(capsys: pytest.CaptureFixture[str]) -> None:
    from veil.cli.main import main

    code = main(
        ["epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "0.01", "--steps", "1000",
         "--delta", "1e-5", "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and "Infinity" not in out, err
    eps = json.loads(out)["epsilon"]
    assert math.isfinite(eps) and eps > 1e5
    # no lower than the exact ε of one unsampled step (P(sampled ≥ once) ≈ 1 − 4e-5 > 1 − δ)
    assert eps >= _gaussian_epsilon(1 / 0.01, DELTA)
