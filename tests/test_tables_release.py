"""DP release of a schema: the mechanisms' guarantees, checked against closed forms and seeded statistics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from veil.accounting.events import Composed, Laplace, event_from_json  # noqa: E402
from veil.mechanisms.laplace import laplace_mechanism  # noqa: E402
from veil.mechanisms.rng import make_source  # noqa: E402
from veil.registry.compose import spent_epsilon  # noqa: E402
from veil.tables.infer import infer_schema  # noqa: E402
from veil.tables.release import (  # noqa: E402
    bound_grid,
    bounds_plan,
    cell_counts,
    dp_bounds,
    occupancy_threshold,
    release_event,
    scale_for,
    threshold_for,
    thresholded_levels,
)
from veil.tables.sources import TableSource  # noqa: E402


@pytest.mark.parametrize("epsilon", [1e-3, 0.05, 1.0, 7.0])
@pytest.mark.parametrize("secure", [False, True])
def test_scale_for_never_charges_more_than_asked(epsilon: float, secure: bool) -> None:
    b = scale_for(epsilon, secure)
    assert release_event(b, secure).pure_epsilon <= epsilon
    assert release_event(b, secure).pure_epsilon > epsilon * (1 - 1e-9)  # and not wastefully less


@pytest.mark.parametrize("coordinates", [1, 2, 3, 17, 1000])
@pytest.mark.parametrize("scale", [0.37, 1.5 * 2**20, 240.0])
def test_the_charged_event_dominates_the_secure_mechanism_for_any_width(
    coordinates: int, scale: float
) -> None:
    """The event is fixed before the data is seen; it must dominate the lattice correction for every d."""
    result = laplace_mechanism(np.zeros(coordinates), sensitivity=1.0, scale=scale, rng=make_source(True))
    assert isinstance(result.event, Laplace)
    assert result.event.sensitivity <= release_event(scale, True).sensitivity


def test_a_value_held_by_one_row_is_released_with_probability_delta() -> None:
    """Closed form: P[1 + Lap(b) > τ] = ½·exp(−(τ−1)/b) = δ. Binomial test, false-failure rate ≈ 1e-6."""
    rng = make_source(False, 1234)
    epsilon, delta, trials = 1.0, 0.05, 4000
    hits = 0
    for _ in range(trials):
        hits += "rare" in thresholded_levels({"rare": 1, "common": 500}, epsilon, delta, rng, 10).levels
    low, high = stats.binom.ppf([5e-7, 1 - 5e-7], trials, delta)
    assert low <= hits <= high, hits
    tau = threshold_for(1 / epsilon, delta)
    assert math.isclose(0.5 * math.exp(-(tau - 1) * epsilon), delta)


def test_frequent_values_are_released_and_capped_by_noisy_count() -> None:
    rng = make_source(False, 7)
    counts = {"a": 5000, "b": 3000, "c": 1000, "rare": 1}
    release = thresholded_levels(counts, 1.0, 1e-6, rng, max_levels=2)
    assert release.levels == ("a", "b")
    assert isinstance(release.event, Laplace) and release.event.pure_epsilon <= 1.0


def test_dp_bounds_bracket_the_bulk_and_charge_one_histogram() -> None:
    """Seeded: with n = 10⁵ at ε = 1 the threshold (≈ 12 values) is far below the 1 % trimmed (1000)."""
    rng = make_source(False, 3)
    values = np.random.default_rng(0).normal(50, 10, 100_000)
    release = dp_bounds(values, 1.0, rng, rows_hint=100_000.0)
    q_lo, q_hi = np.quantile(values, [0.01, 0.99])
    grid = bound_grid()
    assert release.low <= q_lo and release.low >= grid[np.searchsorted(grid, q_lo) - 2]
    assert release.high >= q_hi and release.high <= grid[np.searchsorted(grid, q_hi) + 1]
    assert release.needs_review is None
    assert release.event == bounds_plan(1.0, False)  # what the registry reserved before reading a row
    assert isinstance(release.event, Laplace) and release.event.pure_epsilon <= 1.0


def test_dp_bounds_are_an_interval_even_for_a_constant_column() -> None:
    release = dp_bounds(np.full(1000, 3.0), 0.5, make_source(False, 0))
    assert release.low < release.high


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(-1e14, 1e14, allow_nan=False), max_size=60),
    extra=st.one_of(st.sampled_from([float(g) for g in bound_grid()]), st.floats(-1e14, 1e14)),
)
def test_one_row_moves_one_cell_count_by_one(values: list[float], extra: float) -> None:
    """The L1 sensitivity the histogram's Laplace noise is calibrated to (grid points included)."""
    grid = bound_grid()
    before, after = cell_counts(np.array(values), grid), cell_counts(np.array([*values, extra]), grid)
    assert np.abs(after - before).sum() == 1.0


def test_a_cell_is_seen_with_the_probability_of_its_laplace_noise() -> None:
    """Seeded binomial test (false-failure rate ≈ 1e-6): a cell (4, 5] of c values next to a bulk at 50
    gives the lower bound 4 exactly when c + Lap(b) > τ, with P = 1 − ½·exp(−(c − τ)/b) in closed form."""
    epsilon, trials = 1.0, 1000
    b = scale_for(epsilon, False)
    tau = occupancy_threshold(b, len(bound_grid()) + 1)
    c = math.ceil(tau + b)
    values = np.concatenate([np.full(c, 5.0), np.full(2000, 50.0)])
    rng = make_source(False, 21)
    seen = sum(dp_bounds(values, epsilon, rng, rows_hint=0.0).low == 4.0 for _ in range(trials))
    p = 1 - 0.5 * math.exp(-(c - tau) / b)
    low, high = stats.binom.ppf([5e-7, 1 - 5e-7], trials, p)
    assert low <= seen <= high, (seen, p * trials)


@pytest.mark.parametrize("seed", range(10))
def test_an_age_column_20_to_79_at_epsilon_1_gets_bounds_within_a_factor_1_5(
    tmp_path: Path, seed: int
) -> None:
    """``schema infer --epsilon 1`` on ages 20–79 (2,000 rows, one feature and a target; the bounds get
    ε = 3/8, b ≈ 2.7, τ ≈ 32): a bound lands outside [20/1.5, 30] or [79/1.5, 118.5] only if an empty
    cell looks occupied (probability ≤ β = 1e-3 per run) or the cells (20, 25] and (70, 80], holding
    about 167 and 333 values, both go unseen with the next one (probability < 1e-20). So a seed fails
    with probability ≤ 1e-3. The old noisy binary search released bounds such as [0.08, 5e5] here."""
    ages = np.random.default_rng(seed).integers(20, 80, 2000)
    path = tmp_path / "ages.csv"
    path.write_text("age,y\n" + "".join(f"{a},{'ab'[i % 2]}\n" for i, a in enumerate(ages)))
    result = infer_schema(
        TableSource("csv", str(path)), target="y", epsilon=1.0, rng=make_source(False, 100 + seed)
    )
    low, high = result.schema.column("age").bounds or (0.0, 0.0)
    assert 20 / 1.5 <= low <= 20 * 1.5 and 79 / 1.5 <= high <= 79 * 1.5, (low, high)
    assert result.epsilon <= 1.0


def _mixed_parquet(path: Path, n: int = 20_000) -> None:
    g = np.random.default_rng(1)
    colour = g.choice(["red", "green", "blue"], n, p=[0.5, 0.3, 0.2]).astype(object)
    colour[0] = "ultraviolet"  # held by one row only: must not be released
    income = g.lognormal(10, 0.5, n)
    label = g.choice(["no", "yes"], n)
    pq.write_table(pa.table({"colour": colour, "income": income, "id": np.arange(n), "label": label}), path)


def test_dp_infer_releases_public_levels_not_rare_ones_and_accounts_every_release(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    _mixed_parquet(path)
    result = infer_schema(
        TableSource("parquet", str(path)), target="label", epsilon=2.0, ignore=["id"], rng=make_source(True)
    )
    schema = result.schema
    assert schema.reviewed == "dp" and schema.column("id").type == "ignored"
    assert schema.column("colour").levels == ("blue", "green", "red")
    assert schema.column("label").levels == ("no", "yes")
    low, high = schema.column("income").bounds or (0, 0)
    assert 0 < low < 10_000 and 60_000 < high < 200_000
    # Every release is an event; the composed pure ε is within the budget, and so is PLD's ε at the δ.
    events = event_from_json(schema.dp["events"])
    assert isinstance(events, Composed) and events == result.event
    assert len(events.events) == 1 + 2 * 2  # target histogram; per feature: kind counts + bounds/histogram
    assert result.epsilon <= 2.0
    # The budget registry's composition (RDP here: PLD has no exponential-mechanism event, and the
    # pure-DP sum when tighter) stays within the budget too.
    assert spent_epsilon([list(events.events)], 1e-9) <= 2.0


def test_dp_infer_never_publishes_a_target_class_seen_once(tmp_path: Path) -> None:
    """Issue 23 (planted bug): the TARGET has a class held by one row; ``veil schema infer --epsilon``
    must not publish it (it passes the threshold with probability at most the column's share of δ; three
    runs at the default δ = 1e-7: false failure < 3e-7)."""
    from veil.cli.main import main
    from veil.tables.schema import load_schema

    rng = np.random.default_rng(3)
    rows = [f"{rng.normal():.3f},{'no' if i % 2 else 'yes'}" for i in range(600)] + ["0.5,only-once"]
    path = tmp_path / "t.csv"
    path.write_text("x,label\n" + "\n".join(rows) + "\n")
    for run in range(3):
        out = tmp_path / f"schema{run}.toml"
        assert main(["schema", "infer", f"csv:{path}", "--target", "label", "--epsilon", "4",
                     "--out", str(out)]) == 0  # fmt: skip
        assert load_schema(out).column("label").levels == ("no", "yes")
        assert "only-once" not in out.read_text()
