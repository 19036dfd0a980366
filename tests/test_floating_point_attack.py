"""Mironov's (2012) floating-point attack on the textbook Laplace sampler, and its failure on veil's.

The textbook sampler ``x − b·sign(v)·ln(1 − 2|v|)`` with ``v = U − 1/2`` and ``U`` a double on the
2⁻⁵³ grid can only output a sparse, input-dependent subset of the doubles. An attacker who sees
one exact output can often *certify* which of two neighbouring inputs produced it: the output is
simply unreachable from the other input, whatever the random draw. Such an output breaks ε-DP for
every finite ε.

veil's secure Laplace mechanism outputs lattice points ``Λ·n`` and every integer ``n`` has positive
probability from every input on the lattice, so no output is ever impossible, and the evidence any
single output gives is at most ``e^{Δ/b}``.

Everything here is deterministic given the fixed seeds (no statistical false failures).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from veil.mechanisms import SecureSource, laplace_mechanism, lattice_spacing

TWO52 = 2**52


def textbook_laplace(x: float, b: float, u: np.ndarray) -> np.ndarray:
    """The textbook floating-point sampler (what naive DP libraries did): ``u`` doubles in [0, 1)."""
    v = u - 0.5
    return x - b * np.sign(v) * np.log(1.0 - 2.0 * np.abs(v))


def _noise(b: float, sign: int, j: np.ndarray) -> np.ndarray:
    """The sampler's noise for ``sign(v) = sign`` and ``1 − 2|v| = j·2⁻⁵²`` (all doubles it can use)."""
    return -b * sign * np.log(j.astype(np.float64) * 2.0**-52)


def reachable_textbook(y: np.ndarray, x: float, b: float) -> np.ndarray:
    """For each output ``y``: is there any draw ``U`` (on the 2⁻⁵³ grid) with ``sampler(x, U) == y``?

    The draws are exactly ``sign ∈ {−1, 0, +1}`` and ``j ∈ [1, 2⁵²]``; for a fixed sign, the output
    is monotone in ``j``, so a vectorised binary search finds the candidate ``j`` and a window of
    ±8 around it is checked exactly (tolerating a non-monotone ``log`` at the last ulp).
    """
    y = np.asarray(y, dtype=np.float64)
    found = (x + 0.0 * y) == y  # sign 0: noise is exactly 0
    for sign in (1, -1):
        lo = np.ones(y.shape, dtype=np.int64)
        hi = np.full(y.shape, TWO52, dtype=np.int64)
        # sign=+1: output decreases with j; find the smallest j with output <= y.
        # sign=-1: output increases with j; find the smallest j with output >= y.
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            out = x + _noise(b, sign, mid)
            cond = out <= y if sign == 1 else out >= y
            hi = np.where(cond, mid, hi)
            lo = np.where(cond, lo, mid + 1)
        for off in range(-8, 9):
            j = np.clip(lo + off, 1, TWO52)
            found |= (x + _noise(b, sign, j)) == y
    return found


@pytest.mark.parametrize("b", [1.0, 0.25])
def test_mironov_attack_distinguishes_neighbours_on_textbook_sampler(b: float) -> None:
    rng = np.random.default_rng(2012)
    n = 2000
    u0 = rng.random(n)  # numpy doubles k·2⁻⁵³, exactly the textbook setting
    u1 = rng.random(n)
    y0 = textbook_laplace(0.0, b, u0)  # neighbouring query answers 0 and 1 (sensitivity 1)
    y1 = textbook_laplace(1.0, b, u1)
    y0, y1 = y0[np.isfinite(y0)], y1[np.isfinite(y1)]

    # The certifier is sound: every output is reachable from the input that produced it.
    assert reachable_textbook(y0, 0.0, b).all()
    assert reachable_textbook(y1, 1.0, b).all()

    impossible_from_1 = ~reachable_textbook(y0, 1.0, b)
    impossible_from_0 = ~reachable_textbook(y1, 0.0, b)
    frac = (impossible_from_1.mean() + impossible_from_0.mean()) / 2
    # More than 30% of outputs are certifiably from one input (measured: 79% at b=1, 94% at
    # b=0.25): ε-DP fails for every ε.
    assert frac > 0.30, frac
    # The distinguishing game: answer with certainty when the output is impossible under the
    # other input, otherwise guess. Its accuracy beats the best any ε = 1/b mechanism allows.
    accuracy = 0.5 + frac / 2
    bound = math.exp(1 / b) / (1 + math.exp(1 / b))
    if b == 1.0:
        assert accuracy > bound, (accuracy, bound)


@pytest.mark.parametrize("b", [1.0, 0.25])
def test_mironov_attack_fails_on_veil_secure_laplace(b: float) -> None:
    src = SecureSource()
    n = 600
    y0 = np.array([laplace_mechanism(0.0, sensitivity=1.0, scale=b, rng=src).value for _ in range(n)])
    y1 = np.array([laplace_mechanism(1.0, sensitivity=1.0, scale=b, rng=src).value for _ in range(n)])
    grid = lattice_spacing(b, 1.0)
    t = b / grid

    # The same question: is each output reachable from the other input? Output y is reachable
    # from x iff (y − round(x/Λ)·Λ)/Λ is an integer, since the discrete Laplace gives every
    # integer positive probability.
    for y, other in ((y0, 1.0), (y1, 0.0)):
        n_out = y / grid
        assert np.all(n_out == np.round(n_out)), "an output off the lattice would leak its input"
        z_needed = n_out - np.rint(other / grid)
        assert np.all(z_needed == np.round(z_needed))  # integer noise: positive probability
        # Even the textbook certifier's premise fails: none is impossible under the neighbour.
        # The evidence an output carries is bounded by e^{Δ/b}: |(|n − r0| − |n − r1|)|/t ≤ 1/b.
        log_lr = np.abs(np.abs(n_out - np.rint(0.0 / grid)) - np.abs(n_out - np.rint(1.0 / grid))) / t
        assert log_lr.max() <= 1.0 / b * (1 + 1e-12)


# -- the same attack on the noise DP-SGD training actually releases --------------------------------
def _secure_normal_output(e: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``SecureSource.normal``'s arithmetic for the cosine output of a pair: radius ``√(2E)·scale`` and
    angle ``k·(2π·2⁻⁵³)`` in float64, ``cos θ · r``, then float32."""
    from veil.mechanisms.rng import _ANGLE_STEP

    r = torch.sqrt(2.0 * e) * scale
    return (torch.cos(k.double() * _ANGLE_STEP) * r).to(torch.float32)


def _exponential_at_u_2_pow_minus_53() -> float:
    """``E = −ln u`` as the sampler computes it for the draw ``u = 2⁻⁵³`` (radius 8.57): a first word and
    three more with 12 leading zeros each, then one with 4 leading zeros and mantissa 0."""
    from veil.mechanisms.rng import exponential_from_words

    more = iter([np.zeros(1, np.uint64)] * 3 + [np.array([1 << 59], np.uint64)])
    e = float(exponential_from_words(np.zeros(1, np.uint64), lambda count: next(more))[0])
    assert math.isclose(e, 53 * math.log(2.0), rel_tol=1e-15)
    return e


def reachable_veil_gaussian(v: torch.Tensor, scale: float) -> torch.Tensor:
    """For each float32 noise value ``v``: exhibit a draw of veil's secure Gaussian sampler giving it.

    With ``u = 2⁻⁵³`` (radius 8.57) the output ``r·cos(2π·k·2⁻⁵³)·scale`` decreases in
    ``k ∈ [0, 2⁵²]``; a vectorised binary search finds the candidate ``k`` and ±8 around it are checked
    exactly. Consecutive k move the float64 value by ~10⁻¹⁵, far below a float32 step, so every float32
    within ±8.57·scale is reached. True means reachable (a witness draw was found).
    """
    n = v.numel()
    e = torch.full((n,), _exponential_at_u_2_pow_minus_53(), dtype=torch.float64)
    lo = torch.zeros(n, dtype=torch.int64)
    hi = torch.full((n,), 2**52, dtype=torch.int64)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        out = _secure_normal_output(e, mid, scale)
        cond = out <= v
        hi = torch.where(cond, mid, hi)
        lo = torch.where(cond, lo, mid + 1)
    found = torch.zeros(n, dtype=torch.bool)
    for off in range(-8, 9):
        k = (lo + off).clamp(0, 2**52)
        found |= _secure_normal_output(e, k, scale) == v
    return found


def test_mironov_attack_fails_on_the_noise_dp_sgd_training_releases() -> None:
    """Rerun the certifier on what a training step releases: ``p.grad`` of a step whose clipped sum is 0
    (pure noise, drawn by a default, secure engine), against the neighbour whose sum moves a
    coordinate by one example's largest share, C/B. Every released value is reachable from the
    neighbour too (a witness draw is exhibited), so no output certifies its input."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import veil

    sigma, clip, batch = 1.1, 1.0, 16
    model = nn.Linear(30, 10)
    engine = veil.PrivacyEngine()
    m, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(torch.randn(64, 30)), batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        loss_reduction="sum",
    )
    assert engine.randomness == "secure"
    for (x,) in loader:
        optimizer.zero_grad()
        (m(x) * 0).sum().backward()
        optimizer.step()
        if loader.signal.last_chunk:
            break
    released = torch.cat([p.grad.flatten() for p in m.parameters()])  # float32, noise only
    assert released.dtype == torch.float32 and released.numel() == 310
    std = sigma * clip / batch
    scale = std  # SecureSource.normal: one Box–Muller draw per coordinate, scaled by std
    shift = torch.tensor(clip / batch, dtype=torch.float32)
    grid = math.ldexp(1.0, math.floor(math.log2(std)) - 8)  # the optimizer's release grid
    assert torch.equal(torch.round(released / grid) * grid, released)  # outputs lie on the grid

    def release(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # the optimizer's arithmetic
        return torch.round((v + s) / grid) * grid

    def reachable_from(s: torch.Tensor) -> torch.Tensor:
        """Is each released value y = release(v, s) for some noise value v the sampler can draw?"""
        found = torch.zeros(released.numel(), dtype=torch.bool)
        for j in range(-3, 4):  # noise values that round to y: y − s + j·grid/8
            v = released - s + j * grid / 8
            found |= (release(v, s) == released) & reachable_veil_gaussian(v, scale)
        return found

    # The certifier's premise holds on the input that produced each output, and fails on the
    # neighbour: every output is reachable from both, so none certifies its input.
    assert reachable_from(torch.tensor(0.0)).all()
    assert reachable_from(shift).all()
    # Without the grid the certifier wins on outputs near 0 (what the grid is for): for |y| < Δ/2 any
    # fl32(v + Δ) = y has v ∈ [−3Δ/2, −Δ/2], so v + Δ is exact (Sterbenz) and a multiple of
    # ulp(Δ/2); a raw output off that grid is impossible from the neighbour.
    from veil.mechanisms import SecureSource

    raw = SecureSource().normal((4000,), std)
    near = raw[raw.abs() < 0.5 * clip / batch]
    ulp = math.ldexp(1.0, math.frexp(0.5 * clip / batch)[1] - 24)  # float32 ulp on [Δ/2, Δ)
    certified = torch.remainder(near.double(), ulp) != 0
    assert certified.float().mean() > 0.5
