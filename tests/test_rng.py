"""Randomness sources: reproducibility, state round trips, secure isolation, goodness of fit.

Statistical tests: seeded ones use a fixed seed and α = 1e-3 (deterministic: a correct sampler
fails for at most 1 seed in 1000); those on a SecureSource use fresh OS randomness and α = 1e-6,
so the file fails spuriously with probability ≲ 1e-5 per run.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from veil.errors import InvalidParameterError
from veil.mechanisms import (
    RandomSource,
    SecureSource,
    SeededSource,
    discrete_gaussian_samples,
    discrete_laplace_samples,
    gaussian_mechanism,
    laplace_mechanism,
    make_source,
    report_noisy_max,
    sample_bernoulli_exp,
)

ALPHA = 1e-3


def alpha(src: RandomSource) -> float:
    """α = 1e-3 for seeded draws (deterministic), 1e-6 for fresh OS randomness (CI flake budget)."""
    return 1e-6 if src.secure else ALPHA


def sources() -> list[RandomSource]:
    return [SeededSource(20240607), SecureSource()]


def _draw_everything(src: RandomSource) -> list[object]:
    return [
        src.uniform(5),
        src.integers(-3, 9, size=7),
        src.integers(0, 10**30),
        src.random_bits(130),
        src.bernoulli(9, 0.4),
        src.standard_normal((2, 3)),
        src.normal((4,), 2.0),
        src.normal((3,), 1.0, dtype=torch.float64),
    ]


def _same(a: list[object], b: list[object]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):  # type: ignore[arg-type]
                return False
        elif isinstance(x, np.ndarray):
            if not np.array_equal(x, y):  # type: ignore[arg-type]
                return False
        elif x != y:
            return False
    return True


def test_importing_mechanisms_does_not_import_torch_or_scipy() -> None:
    import subprocess
    import sys

    code = "import sys, veil.mechanisms; print(sorted({'torch', 'scipy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- seeded ---------------------------------------------------------------------------------------
def test_seeded_source_is_reproducible_and_seed_dependent() -> None:
    assert _same(_draw_everything(SeededSource(7)), _draw_everything(SeededSource(7)))
    assert not _same(_draw_everything(SeededSource(7)), _draw_everything(SeededSource(8)))


def test_seeded_state_dict_round_trips_exactly_through_json() -> None:
    src = SeededSource(11)
    _draw_everything(src)  # advance both the numpy and the torch stream
    saved = json.loads(json.dumps(src.state_dict()))
    expected = _draw_everything(src)
    other = SeededSource(999)
    _draw_everything(other)
    other.load_state_dict(saved)
    assert other.seed == 11
    assert _same(_draw_everything(other), expected)
    src.load_state_dict(saved)  # rewinding the same object works too
    assert _same(_draw_everything(src), expected)


def test_seeded_state_saved_before_torch_use_restarts_the_torch_stream() -> None:
    src = SeededSource(5)
    src.uniform(3)
    saved = src.state_dict()
    assert saved["torch"] == {}
    first = src.normal((6,), 1.0)
    src.load_state_dict(saved)
    assert torch.equal(src.normal((6,), 1.0), first)


def test_seeded_rejects_bad_seeds_and_foreign_states() -> None:
    for bad in (-1, 2**64, 1.5, True, "3"):
        with pytest.raises(InvalidParameterError):
            SeededSource(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="seeded"):
        SeededSource(1).load_state_dict({"secure": True})


# -- secure ---------------------------------------------------------------------------------------
def test_secure_state_cannot_be_replayed() -> None:
    src = SecureSource()
    assert src.state_dict() == {"secure": True}
    src.load_state_dict({"secure": True})
    with pytest.raises(InvalidParameterError, match="cannot replay"):
        src.load_state_dict(SeededSource(3).state_dict())
    with pytest.raises(InvalidParameterError):
        src.load_state_dict({"secure": True, "seed": 3})


def test_make_source_choices() -> None:
    assert isinstance(make_source(True), SecureSource)
    with pytest.raises(InvalidParameterError, match="seed"):
        make_source(True, 42)
    seeded = make_source(False, 42)
    assert isinstance(seeded, SeededSource) and seeded.seed == 42
    drawn = [make_source(False) for _ in range(2)]
    assert all(isinstance(d, SeededSource) for d in drawn)
    # A fresh OS seed is drawn and exposed, never a fixed default (collision chance 2⁻⁶³).
    assert drawn[0].seed != drawn[1].seed  # type: ignore[attr-defined]
    with pytest.raises(InvalidParameterError):
        make_source("yes")  # type: ignore[arg-type]


@pytest.fixture
def forbid_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every seeded generator in numpy, torch and ``random`` raise when touched."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a seeded PRNG was used in secure mode")

    for name in ("Generator", "default_rng", "PCG64", "Philox", "MT19937", "SFC64", "RandomState"):
        monkeypatch.setattr(np.random, name, boom)
    for name in ("random", "rand", "randn", "normal", "standard_normal", "randint", "integers", "laplace"):
        if hasattr(np.random, name):
            monkeypatch.setattr(np.random, name, boom)
    for name in ("randn", "rand", "normal", "randint", "bernoulli", "Generator", "manual_seed", "randperm"):
        monkeypatch.setattr(torch, name, boom)
    for name in ("normal_", "uniform_", "random_", "bernoulli_", "exponential_"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for name in ("random", "getrandbits", "randrange", "randint", "gauss", "uniform"):
        monkeypatch.setattr(random, name, boom)


@pytest.mark.usefixtures("forbid_seeded")
def test_secure_mode_never_touches_a_seeded_generator() -> None:
    src = SecureSource()
    _draw_everything(src)
    src.normal((5,), 1.0, dtype=torch.bfloat16)
    laplace_mechanism(np.zeros(3), sensitivity=1.0, scale=1.0, rng=src)
    gaussian_mechanism(0.5, sensitivity=1.0, std=2.0, rng=src)
    report_noisy_max([3, 9, 4], "laplace", 2.0, src)
    report_noisy_max([3, 9, 4], "gaussian", 2.0, src)
    discrete_laplace_samples(Fraction(3, 2), 5, src)
    discrete_gaussian_samples(Fraction(9, 4), 5, src)
    sample_bernoulli_exp(Fraction(1, 3), src)
    # The patch is effective: a seeded source cannot even be built under it.
    with pytest.raises(AssertionError, match="seeded PRNG"):
        SeededSource(1)


# Fork safety, key hygiene and the Gaussian transform's fit: tests/test_rng_secure_normal.py.


# -- goodness of fit ------------------------------------------------------------------------------
@pytest.mark.parametrize("src", sources(), ids=["seeded", "secure"])
def test_uniform_and_standard_normal_fit(src: RandomSource) -> None:
    u = src.uniform(20000)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > alpha(src)
    z = src.standard_normal(20000)
    assert stats.kstest(z, "norm").pvalue > alpha(src)


@pytest.mark.parametrize("src", sources(), ids=["seeded", "secure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_tensor_fits_its_scale(src: RandomSource, dtype: torch.dtype) -> None:
    std = 3.5
    z = src.normal((20000,), std, dtype=dtype)
    assert z.dtype == dtype and z.shape == (20000,)
    assert stats.kstest(z.double().numpy(), "norm", args=(0.0, std)).pvalue > alpha(src)


@pytest.mark.parametrize("src", sources(), ids=["seeded", "secure"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_noise_has_the_right_scale(src: RandomSource, dtype: torch.dtype) -> None:
    # bf16/fp16 outputs are rounded, so test the variance: s²/σ² has sd √(2/n) ≈ 0.0045 at n=1e5;
    # the band ±0.025 (5.6 sd, plus < 0.2% rounding bias) fails a correct sampler w.p. < 1e-7.
    std = 0.01
    z = src.normal((100000,), std, dtype=dtype)
    assert z.dtype == dtype
    ratio = float(z.double().var()) / std**2
    assert abs(ratio - 1.0) < 0.025, ratio


@pytest.mark.parametrize("src", sources(), ids=["seeded", "secure"])
def test_bernoulli_rate_and_rounding(src: RandomSource) -> None:
    n = 40000
    for p in (0.3, 0.002):
        k = int(src.bernoulli(n, p).sum())
        assert stats.binomtest(k, n, p).pvalue > alpha(src)
    assert not src.bernoulli(1000, 0.0).any() and src.bernoulli(1000, 1.0).all()
    # p̃ = ⌊p·2⁵³⌋/2⁵³ ≤ p: a rate below one 53-bit step is exactly zero, never rounded up.
    assert not src.bernoulli(100000, 2.0**-54).any()
    with pytest.raises(InvalidParameterError):
        src.bernoulli(3, 1.5)


@pytest.mark.parametrize("src", sources(), ids=["seeded", "secure"])
def test_integers_and_bits_are_uniform(src: RandomSource) -> None:
    n = 30000
    x = src.integers(-3, 7, size=n)  # 10 values: not a power of two, so rejection matters
    assert isinstance(x, np.ndarray) and x.dtype == np.int64 and x.min() >= -3 and x.max() <= 6
    assert stats.chisquare(np.bincount(x + 3, minlength=10)).pvalue > alpha(src)
    bits = np.array([src.random_bits(3) for _ in range(8000)])
    assert stats.chisquare(np.bincount(bits, minlength=8)).pvalue > alpha(src)
    big = [src.randbelow(3 * 10**40) for _ in range(200)]
    assert all(0 <= v < 3 * 10**40 for v in big) and max(big) > 10**40  # P(fail) = (1/3)^200
    assert src.random_bits(0) == 0 and 0 <= src.random_bits(200) < 2**200
    # The top bit of a wide draw is fair (binomial test).
    top = sum(src.random_bits(100) >> 99 for _ in range(4000))
    assert stats.binomtest(top, 4000, 0.5).pvalue > alpha(src)
    with pytest.raises(InvalidParameterError):
        src.integers(5, 5)


def test_integers_large_span_uses_full_range() -> None:
    src = SeededSource(3)
    x = src.integers(0, 2**63, size=20000)
    assert isinstance(x, np.ndarray) and x.min() >= 0
    # Upper half of the range must occur half the time (binomial, α = 1e-3).
    assert stats.binomtest(int((x >= 2**62).sum()), 20000, 0.5).pvalue > ALPHA
    assert math.isclose(float(x.mean()) / 2**63, 0.5, abs_tol=0.02)
