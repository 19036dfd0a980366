"""Privacy-loss-distribution (PLD) accountant: FFT composition with pessimistic discretisation.

Guarantee. For every composed event the accountant builds a *dominating* discrete privacy-loss
distribution: a distribution on the grid ``{kΔ}`` (plus an atom at +∞) whose hockey-stick curve
``δ(ε)`` is at least the true one for every ε. It is obtained by the "connect the dots"
construction (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022): the exact ``δ(ε)`` of the
mechanism is evaluated at the grid points and linearly interpolated in ``e^ε`` between them.
Since ``δ`` is convex in ``e^ε``, the chord lies above the curve, so discretisation can only raise
ε. Dominating pairs compose (Zhu, Dong & Wang 2022), so the composed grid distribution dominates
the composed mechanism. Composition is a product of Fourier transforms on a circular grid sized
to hold the composed distribution; mass that could fall beyond the top of that grid is bounded
with a Chernoff bound and *added* to δ, and mass folded in from below can only raise δ, so no
step of the computation lowers ε.

Neighbouring relations. Under add/remove-one the adversary's neighbour is either D plus a record
or D minus one for the whole run; both directions are composed separately and the worse one is
reported. Under replace-one only unsampled Gaussian/Laplace events are accepted (their noise is
relative to the replace-one sensitivity), and their loss distribution is the q = 1 case.

Supported leaves: Gaussian, Laplace, and Poisson-sampled Gaussian/Laplace with any rate, in any
heterogeneous mix (e.g. σ changing during a run).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.accounting.events import (
    Composed,
    Gaussian,
    Laplace,
    Neighbouring,
    NonPrivate,
    NoOp,
    PoissonSampled,
    PrivacyEvent,
    SelfComposed,
)
from veil.accounting.interface import PrivacyAccountant, check_delta, check_epsilon
from veil.errors import InvalidParameterError

__all__ = ["PLDAccountant"]

Direction = Literal["remove", "add"]

# Per-step mass allowed beyond the top of a step's grid; it is kept as an atom at +∞ (counted in δ).
_STEP_TAIL = 1e-22
# The composed grid leaves out at most about this much mass on either side (bounded exactly later).
_WINDOW_TAIL = 1e-18
_FFT_POINTS = 1 << 18
_MIN_INTERVAL = 1e-6
_MAX_LOSS = 600.0  # beyond this e^ε overflows; losses above are treated as infinite (pessimistic)


@dataclass(frozen=True)
class _AdditiveNoise:
    """Noise ``Z`` of the mechanism ``M(D) = f(D) + Z`` with sensitivity normalised to 1."""

    family: Literal["gaussian", "laplace"]
    scale: float  # σ for Gaussian, b for Laplace (both relative to the sensitivity)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        if self.family == "gaussian":
            from scipy import special

            return special.ndtr(x / self.scale)
        z = x / self.scale
        return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0)), 1 - 0.5 * np.exp(-np.maximum(z, 0)))

    def sf(self, x: np.ndarray) -> np.ndarray:
        return self.cdf(-x)

    @property
    def log_ratio_bounds(self) -> tuple[float, float]:
        """Range of log f(x−1)/f(x)."""
        if self.family == "gaussian":
            return -math.inf, math.inf
        return -1 / self.scale, 1 / self.scale

    def inverse_log_ratio(self, log_r: np.ndarray) -> np.ndarray:
        """x such that log f(x−1)/f(x) = log_r (the ratio is increasing in x)."""
        if self.family == "gaussian":
            return self.scale**2 * log_r + 0.5
        return (self.scale * log_r + 1) / 2

    def tail_quantile(self, tail: float) -> float:
        """z with P(Z > z) ≤ tail."""
        if self.family == "gaussian":
            from scipy import special

            return float(-special.ndtri(tail)) * self.scale
        return -self.scale * math.log(2 * tail)


@dataclass(frozen=True)
class _Pair:
    """A dominating pair (P, Q) for one event: P = (1−q)Z + q(Z+1) vs Q = Z ("remove") or swapped."""

    noise: _AdditiveNoise
    q: float
    direction: Direction

    def _log_r_star(self, eps: np.ndarray) -> np.ndarray:
        # remove: L>ε ⟺ r(x) > (e^ε − 1 + q)/q ; add: L>ε ⟺ r(x) < (e^{−ε} − 1 + q)/q
        signed = eps if self.direction == "remove" else -eps
        with np.errstate(divide="ignore", invalid="ignore"):
            num = np.expm1(signed) + self.q
            return np.where(num > 0, np.log(np.where(num > 0, num, 1.0)) - math.log(self.q), -np.inf)

    def tails(self, eps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """P(L>ε), P(L≤ε), Q(L>ε), Q(L≤ε) for the privacy loss L = log dP/dQ, each computed directly."""
        lo, hi = self.noise.log_ratio_bounds
        log_r = self._log_r_star(eps)
        t = self.noise.inverse_log_ratio(np.clip(log_r, max(lo, -1e6), min(hi, 1e6)))
        base_gt, base_le = self.noise.sf(t), self.noise.cdf(t)
        mix_gt = (1 - self.q) * base_gt + self.q * self.noise.sf(t - 1)
        mix_le = (1 - self.q) * base_le + self.q * self.noise.cdf(t - 1)
        if self.direction == "remove":  # {L > ε} = {x > t}; P = mixture, Q = base
            p_gt, p_le, q_gt, q_le = mix_gt, mix_le, base_gt, base_le
            everything = log_r < lo
            nothing = log_r >= hi
        else:  # {L > ε} = {x < t}; P = base, Q = mixture
            p_gt, p_le, q_gt, q_le = base_le, base_gt, mix_le, mix_gt
            everything = log_r > hi
            nothing = log_r <= lo
        one, zero = np.ones_like(eps), np.zeros_like(eps)
        p_gt = np.where(everything, one, np.where(nothing, zero, p_gt))
        p_le = np.where(everything, zero, np.where(nothing, one, p_le))
        q_gt = np.where(everything, one, np.where(nothing, zero, q_gt))
        q_le = np.where(everything, zero, np.where(nothing, one, q_le))
        return p_gt, p_le, q_gt, q_le

    def loss(self, x: float) -> float:
        """Privacy loss at outcome x."""
        n = self.noise
        if n.family == "gaussian":
            log_r = (2 * x - 1) / (2 * n.scale**2)
        else:
            log_r = (abs(x) - abs(x - 1)) / n.scale
        mix = np.logaddexp(math.log1p(-self.q) if self.q < 1 else -math.inf, math.log(self.q) + log_r)
        return float(mix if self.direction == "remove" else -mix)

    def loss_range(self) -> tuple[float, float]:
        """An interval of losses holding all but ~_STEP_TAIL of P's mass (exact for Laplace)."""
        z = self.noise.tail_quantile(_STEP_TAIL)
        if self.noise.family == "laplace":
            z = min(z, 0.0)  # the loss is constant outside [0, 1]
            a, b = self.loss(-z), self.loss(1 + z)
            return min(a, b), max(a, b)
        if self.direction == "remove":
            return self.loss(-z), self.loss(1 + z)
        return self.loss(z), self.loss(-z)


@dataclass
class _StepPMF:
    """Dominating discrete loss distribution of one step: probs[i] at loss (offset+i)·Δ, plus +∞."""

    offset: int
    probs: np.ndarray
    infinity: float

    def log_mgf(self, t: np.ndarray, interval: float) -> np.ndarray:
        """log Σ_i p_i e^{t·l_i} for each t (finite part only)."""
        losses = (self.offset + np.arange(len(self.probs))) * interval
        with np.errstate(divide="ignore"):
            logp = np.log(self.probs)
        z = logp[None, :] + t[:, None] * losses[None, :]
        m = np.max(z, axis=1)
        return m + np.log(np.sum(np.exp(z - m[:, None]), axis=1))


def _discretise(pair: _Pair, interval: float) -> _StepPMF:
    """Connect-the-dots dominating PMF of ``pair`` on the grid of multiples of ``interval``."""
    lo, hi = pair.loss_range()
    hi = min(hi, _MAX_LOSS)
    k_lo = math.floor(lo / interval)
    k_hi = max(math.ceil(hi / interval), k_lo + 1)
    eps = np.arange(k_lo, k_hi + 1) * interval
    p_gt, p_le, q_gt, q_le = pair.tails(eps)
    # Bucket masses on (ε_i, ε_{i+1}], differencing whichever tail is small (no cancellation).
    p_b = np.where(p_gt[:-1] <= 0.5, p_gt[:-1] - p_gt[1:], p_le[1:] - p_le[:-1])
    q_b = np.where(q_gt[:-1] <= 0.5, q_gt[:-1] - q_gt[1:], q_le[1:] - q_le[:-1])
    p_b, q_b = np.maximum(p_b, 0), np.maximum(q_b, 0)
    # Inside a bucket dP/dQ ∈ (e^{ε_i}, e^{ε_{i+1}}]; the chord splits its Q-mass between the two ends:
    # c_i goes to the upper end, q_b − c_i to the lower end.
    c = (p_b * np.exp(-eps[:-1]) - q_b) / math.expm1(interval)
    c = np.clip(c, 0, q_b)
    q_mass = np.empty(len(eps))
    q_mass[:-1] = q_b - c
    q_mass[-1] = q_gt[-1]
    q_mass[1:] += c
    # Everything below ε_0 is moved up to ε_0 (the chord from ε = −∞, δ = 1).
    q_mass[0] += p_le[0] * math.exp(-eps[0])
    probs = np.maximum(q_mass * np.exp(eps), 0)
    infinity = float(p_gt[-1])  # ≥ δ(ε_top): the P-mass beyond the grid counts as infinite loss
    if hi >= _MAX_LOSS:
        infinity = max(infinity, float(p_gt[-1]))
    return _StepPMF(k_lo, probs, infinity)


def _leaves(event: PrivacyEvent, count: int, out: Counter[PrivacyEvent]) -> None:
    if isinstance(event, NoOp) or count == 0:
        return
    if isinstance(event, SelfComposed):
        _leaves(event.event, count * event.count, out)
    elif isinstance(event, Composed):
        for e in event.events:
            _leaves(e, count, out)
    else:
        out[event] += count


def _pair_of(event: PrivacyEvent, direction: Direction) -> _Pair:
    q = 1.0
    if isinstance(event, PoissonSampled):
        q, event = event.sampling_rate, event.event
    if isinstance(event, Gaussian):
        return _Pair(_AdditiveNoise("gaussian", event.noise_multiplier), q, direction)
    assert isinstance(event, Laplace)
    return _Pair(_AdditiveNoise("laplace", event.noise_multiplier), q, direction)


@dataclass
class _Composition:
    """The composed dominating PMF of one direction on the window [start, start+len)·Δ."""

    interval: float
    start: int
    probs: np.ndarray
    constant: float  # mass counted at +∞: infinite losses plus the bound on mass beyond the window

    @property
    def losses(self) -> np.ndarray:
        return (self.start + np.arange(len(self.probs))) * self.interval

    def delta(self, epsilon: float) -> float:
        losses = self.losses
        above = losses > epsilon
        d = float(np.sum(self.probs[above] * -np.expm1(epsilon - losses[above])))
        return min(1.0, d + self.constant)

    def epsilon(self, delta: float) -> float:
        if self.constant >= delta:
            return math.inf
        p, losses = self.probs, self.losses
        top = losses[-1]
        tail_mass = np.cumsum(p[::-1])[::-1]  # A_j = Σ_{i≥j} p_i
        weighted = np.cumsum((p * np.exp(np.minimum(top - losses, 700.0)))[::-1])[::-1]
        # D(l_j) = const + A_{j+1} − e^{l_j − top} B_{j+1}
        a_next = np.append(tail_mass[1:], 0.0)
        b_next = np.append(weighted[1:], 0.0)
        d_grid = self.constant + a_next - np.exp(losses - top) * b_next
        ok = np.nonzero(d_grid <= delta)[0]
        if len(ok) == 0:
            return math.inf
        j = int(ok[0])
        # On (l_{j−1}, l_j]: D(ε) = const + A_j − e^{ε−top} B_j; solve D(ε) = δ.
        a_j, b_j = tail_mass[j], weighted[j]
        if j == 0 or b_j <= 0 or self.constant + a_j - delta <= 0:
            eps = losses[j] if j > 0 else min(losses[0], 0.0)
        else:
            eps = top + math.log((self.constant + a_j - delta) / b_j)
            eps = min(max(eps, losses[j - 1]), losses[j])
        return max(0.0, float(eps))


class PLDAccountant(PrivacyAccountant):
    """The default accountant: tight, pessimistic PLD composition. See the module docstring."""

    name = "pld"

    def __init__(
        self, neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE, *, fft_points: int = _FFT_POINTS
    ) -> None:
        """``fft_points`` sets the grid resolution (a speed/tightness knob: any value is sound)."""
        super().__init__(neighbouring)
        if fft_points < 1024:
            raise InvalidParameterError(
                "fft_points", fft_points, "too coarse a grid gives a uselessly loose ε", "pass at least 1024"
            )
        self.fft_points = int(fft_points)
        self._counts: Counter[PrivacyEvent] = Counter()
        self._non_private = False
        self._cache: dict[Direction, _Composition] = {}

    def _supports_leaf(self, event: PrivacyEvent) -> bool:
        # Exact types: an unknown subclass may mean something else and is refused, not guessed.
        if type(event) in (Gaussian, Laplace):
            return True
        return type(event) is PoissonSampled and type(event.event) in (Gaussian, Laplace)

    def _add(self, event: PrivacyEvent) -> None:
        if _contains_non_private(event):
            self._non_private = True
        leaves: Counter[PrivacyEvent] = Counter()
        _leaves(event, 1, leaves)
        leaves.pop(NonPrivate(), None)
        self._counts.update(leaves)
        self._cache.clear()

    # -- composition -------------------------------------------------------------------------
    def _directions(self) -> tuple[Direction, ...]:
        if self.neighbouring is Neighbouring.REPLACE_ONE:
            return ("remove",)  # symmetric noise, q = 1: one direction covers both
        return ("remove", "add")

    def _composition(self, direction: Direction) -> _Composition:
        cached = self._cache.get(direction)
        if cached is None:
            cached = _compose(
                [
                    (_pair_of(e, direction), n)
                    for e, n in sorted(self._counts.items(), key=lambda kv: kv[0].to_json())
                ],
                self.fft_points,
            )
            self._cache[direction] = cached
        return cached

    def epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        if self._non_private:
            return math.inf
        if not self._counts:
            return 0.0
        return max(self._composition(d).epsilon(delta) for d in self._directions())

    def delta(self, epsilon: float) -> float:
        epsilon = check_epsilon(epsilon)
        if self._non_private:
            return 1.0
        if not self._counts:
            return 0.0
        return max(self._composition(d).delta(epsilon) for d in self._directions())


def _contains_non_private(event: PrivacyEvent) -> bool:
    if isinstance(event, NonPrivate):
        return True
    if isinstance(event, SelfComposed):
        return event.count > 0 and _contains_non_private(event.event)
    if isinstance(event, Composed):
        return any(_contains_non_private(e) for e in event.events)
    return False


def _compose(groups: list[tuple[_Pair, int]], fft_points: int) -> _Composition:
    """Compose ``count`` copies of each pair's dominating PMF; see the module docstring."""
    # 1. Coarse PMFs locate the composed distribution: Chernoff bounds on their MGFs give a window
    #    outside of which only ~_WINDOW_TAIL of the mass lies. (Soundness does not depend on this:
    #    the fine computation bounds whatever it leaves out.)
    coarse = 1e-3
    pmfs = [(_discretise(pair, coarse), n) for pair, n in groups]
    lo_sum = sum(n * pmf.offset * coarse for pmf, n in pmfs)
    hi_sum = sum(n * (pmf.offset + len(pmf.probs) - 1) * coarse for pmf, n in pmfs)
    w_lo, w_hi = lo_sum, hi_sum
    ts = np.geomspace(1e-3, 1e3, 48)
    log_tail = math.log(_WINDOW_TAIL)
    k_up = sum(n * pmf.log_mgf(ts, coarse) for pmf, n in pmfs)
    k_down = sum(n * pmf.log_mgf(-ts, coarse) for pmf, n in pmfs)
    with np.errstate(invalid="ignore", over="ignore"):
        tops = (k_up - log_tail) / ts
        t_star = float(ts[int(np.nanargmin(tops))])
        w_hi = min(w_hi, float(np.nanmin(tops)))
        w_lo = max(w_lo, float(np.nanmax(-(k_down - log_tail) / ts)))
    w_lo, w_hi = w_lo - 2 * coarse, w_hi + 2 * coarse
    widest_step = max((len(pmf.probs) * coarse for pmf, _ in pmfs), default=coarse)
    # 2. The fine grid: fft_points across the window, but never so fine that one step's PMF
    #    needs more than 4·fft_points cells.
    interval = max(_MIN_INTERVAL, (w_hi - w_lo) / (fft_points - 16), widest_step / (4 * fft_points))
    return _compose_on_window(groups, interval, w_lo, w_hi, exact_top=w_hi >= hi_sum, t_star=t_star)


def _compose_on_window(
    groups: list[tuple[_Pair, int]], interval: float, w_lo: float, w_hi: float, exact_top: bool, t_star: float
) -> _Composition:
    from scipy import fft

    start = math.floor(w_lo / interval)
    size = math.ceil(w_hi / interval) - start + 1
    n_fft = fft.next_fast_len(size, real=True)
    spectrum = np.ones(n_fft // 2 + 1, dtype=complex)
    infinity_free = 1.0  # probability that no step hits +∞
    offset_total = 0
    pmfs = []
    for pair, n in groups:
        pmf = _discretise(pair, interval)
        pmfs.append((pmf, n))
        folded = np.bincount(np.arange(len(pmf.probs)) % n_fft, weights=pmf.probs, minlength=n_fft)
        spectrum *= _power(fft.rfft(folded), n)
        offset_total += n * pmf.offset
        infinity_free *= (1 - pmf.infinity) ** n
    circular = fft.irfft(spectrum, n_fft)
    # Position m of the circular result holds total index offset_total + m (mod n_fft).
    probs = np.roll(circular, (offset_total - start) % n_fft)[:size]
    probs = np.maximum(probs, 0.0)
    constant = -math.expm1(sum(n * math.log1p(-pmf.infinity) for pmf, n in pmfs)) if pmfs else 0.0
    if not exact_top:
        constant += _upper_tail_bound(pmfs, interval, (start + size) * interval, t_star)
    # Float64 round-off of the FFTs and the repeated squaring (errors of ~1e-16·log n per Fourier
    # coefficient, spread over the grid): a generous estimate, added so it cannot lower ε.
    constant += 1e-15 * math.sqrt(n_fft) * (1 + math.log2(1 + sum(n for _, n in pmfs)))
    return _Composition(interval, start, probs, min(1.0, constant))


def _power(z: np.ndarray, n: int) -> np.ndarray:
    """z**n by repeated squaring: n-fold self-composition in the Fourier domain."""
    result: np.ndarray | None = None
    base = z.copy()
    while n:
        if n & 1:
            result = base.copy() if result is None else result * base
        n >>= 1
        if n:
            base *= base
    return np.ones_like(z) if result is None else result


def _upper_tail_bound(pmfs: list[tuple[_StepPMF, int]], interval: float, threshold: float, t: float) -> float:
    """Chernoff bound E[e^{tS}]·e^{−t·threshold} on the composed finite mass at losses ≥ threshold.

    Any t > 0 gives a valid bound; ``t`` is the one that sized the window, which makes the bound
    about as small as the window was designed for (≈ _WINDOW_TAIL).
    """
    ts = np.array([t / 2, t, 2 * t])
    log_bound = -ts * threshold
    for pmf, n in pmfs:
        log_bound = log_bound + n * pmf.log_mgf(ts, interval)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_bound))))))
