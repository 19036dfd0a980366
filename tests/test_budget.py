"""Budget arithmetic with a prefix of spent events (veil.accounting.calibrate) and seed derivation."""

from __future__ import annotations

import numpy as np
import pytest

from veil.accounting.calibrate import (
    calibrate_noise,
    dpsgd_epsilon,
    dpsgd_event,
    epsilon_at,
    epsilon_curve,
    epsilon_of,
    max_steps,
    with_steps,
)
from veil.accounting.events import Gaussian, PoissonSampled, SelfComposed
from veil.errors import UnreachableTargetError
from veil.pipeline.seeds import Purpose, derive_seed

PREFIX = [Gaussian(4.0)]  # e.g. a DP preprocessing release
Q, STEPS, DELTA = 0.05, 200, 1e-5


def test_epsilon_of_composes_the_events() -> None:
    assert epsilon_of([], DELTA) == 0.0
    step = dpsgd_event(Q, 1.1)
    assert epsilon_of([SelfComposed(step, STEPS)], DELTA) == pytest.approx(
        dpsgd_epsilon(Q, 1.1, STEPS, DELTA), rel=1e-9
    )
    assert epsilon_of([*PREFIX, SelfComposed(step, STEPS)], DELTA) > epsilon_of(
        [SelfComposed(step, STEPS)], DELTA
    )


def test_one_step_event_everywhere_q_1_is_the_plain_gaussian() -> None:
    assert dpsgd_event(1.0, 2.0) == Gaussian(2.0)
    assert dpsgd_event(0.5, 2.0) == PoissonSampled(0.5, Gaussian(2.0))


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibration_after_a_prefix_lands_on_the_private_side_and_is_tight(accountant: str) -> None:
    target = 3.0
    sigma = calibrate_noise(target, DELTA, Q, STEPS, accountant, prefix=PREFIX)  # type: ignore[arg-type]
    alone = calibrate_noise(target, DELTA, Q, STEPS, accountant)  # type: ignore[arg-type]
    assert sigma > alone  # the prefix leaves less for the steps

    def eps(s: float) -> float:
        return epsilon_of(with_steps(PREFIX, dpsgd_event(Q, s), STEPS), DELTA, accountant)  # type: ignore[arg-type]

    assert eps(sigma) <= target < eps(sigma / 1.0025)


def test_calibration_refuses_a_prefix_that_spends_the_whole_target() -> None:
    with pytest.raises(UnreachableTargetError, match="already use the whole target"):
        calibrate_noise(0.5, DELTA, Q, STEPS, prefix=[Gaussian(0.5)])


def test_max_steps_after_a_prefix_is_the_largest_that_fits() -> None:
    target, sigma = 2.0, 1.2
    k = max_steps(sigma, Q, target, DELTA, prefix=PREFIX, limit=10_000)
    step = dpsgd_event(Q, sigma)
    assert 0 < k < 10_000
    assert (
        epsilon_of(with_steps(PREFIX, step, k), DELTA)
        <= target
        < epsilon_of(with_steps(PREFIX, step, k + 1), DELTA)
    )
    assert k < max_steps(sigma, Q, target, DELTA, limit=10_000)
    assert max_steps(sigma, Q, target, DELTA, prefix=PREFIX, limit=k - 3) == k - 3  # capped by the limit
    assert max_steps(sigma, Q, 0.5, DELTA, prefix=[Gaussian(0.5)], limit=100) == 0


def test_epsilon_curve_starts_at_the_prefix_and_reads_conservatively() -> None:
    step = dpsgd_event(Q, 1.1)
    curve = epsilon_curve(step, 100, DELTA, prefix=PREFIX)
    assert curve[0] == (0, pytest.approx(epsilon_of(PREFIX, DELTA)))
    assert curve[-1][0] == 100 and [e for _, e in curve] == sorted(e for _, e in curve)
    k = curve[1][0] - 1 if curve[1][0] > 1 else 1
    assert epsilon_at(curve, k) >= epsilon_of(with_steps(PREFIX, step, k), DELTA)


def test_derived_seeds_keep_train_values_and_separate_purposes() -> None:
    # The values `veil train` used before the derivation was shared (the engine, the baseline).
    for purpose, legacy in ((Purpose.ENGINE, 2), (Purpose.BASELINE, 3), (Purpose.AUDIT, 11)):
        assert derive_seed(5, purpose) == int(np.random.SeedSequence([5, legacy]).generate_state(1)[0])
    seeds = {derive_seed(0, p, i) for p in Purpose for i in range(3)}
    assert len(seeds) == 3 * len(Purpose)
    assert derive_seed(1, Purpose.SHADOW, 2) == derive_seed(1, Purpose.SHADOW, 2)
