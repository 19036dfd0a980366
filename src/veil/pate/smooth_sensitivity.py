"""Releasing the data-dependent privacy cost privately: smooth sensitivity and the GNSS mechanism.

The data-dependent RDP ``r(D)`` of the released labels (:mod:`veil.pate.analysis`) is a function
of the private votes, so publishing it would leak. Following Papernot et al. (2018, §4 and
App. C) it is released through the Gaussian noise / smooth sensitivity (GNSS) mechanism with a
β-smooth upper bound ``S`` on the local sensitivity of ``r`` (Nissim, Raskhodnikova & Smith 2007).

Distance. Two vote sets are at distance k when k teachers vote differently (one private record
changes one teacher, which changes every query's histogram by one vote). ``r`` sums a per-query
term ``F(q̃)``, ``F`` non-decreasing (see :func:`veil.pate.analysis.data_dependent_rdp`).

``A⁽ᵏ⁾`` bounds the local sensitivity of ``r`` anywhere within distance k (summed over queries):

* GNMax term. Let ``n''`` be within distance k of the histogram: its sorted gaps
  ``g''_j = s''₁ − s''_j`` lie in the box ``[max(0, g_j − 2k), min(K, g_j + 2k)]`` (the top count
  moves by ≤ k, every other order statistic by ≤ k). A neighbour of ``n''`` has each sorted gap
  within ±2 of ``g''``, so its ``q̃`` lies in ``[b, a]`` with ``a = q̃(max(g'' − 2, 0))`` and
  ``b = q̃(min(g'' + 2, K))``, and ``LS(n'') ≤ F(a) − F(b)``. Per class ``b_j/a_j ≥ ρ(x_j)``,
  ``x_j = max(g''_j − 2, 0)``, ``ρ(x) = Pr[N ≥ x + 4]/Pr[N ≥ x]`` (``N ~ N(0, 2σ²)`` shifted by
  the lattice slack), decreasing in x (the Gaussian tail is log-concave). Splitting the classes at
  any τ gives ``b ≥ ψ(a) = max_τ ρ(τ)·(a − (C−1)·Pr[N ≥ τ])``. With ``a`` in the interval
  ``[q̃(box top − 2), q̃(box bottom − 2)]`` and ``F``, ``ψ`` increasing, the maximum of
  ``F(a) − F(ψ(a))`` over that interval is bounded cell by cell on a fixed grid
  ``a₀ < a₁ < …``: ``F(a_{i+1}) − F(ψ(a_i))``.
* Threshold term. The top count of ``n''`` lies in ``[m − k, m + k]``; ``LS(n'')`` is at most the
  largest ``|F(j + 1) − F(j)|`` with ``j, j + 1`` within ``[m − k − 1, m + k + 1] ∩ [0, K]``.

Both enclosures grow with k and are nested for neighbouring vote sets
(``A⁽ᵏ⁾(D) ≤ A⁽ᵏ⁺¹⁾(D')``), so ``S(D) = max_k e^{−βk}·A⁽ᵏ⁾(D)`` is a β-smooth upper bound on the
local sensitivity: ``S ≥ LS`` and ``S(D) ≤ e^β·S(D')``. Beyond ``k = K`` nothing grows any more,
so ``k ≤ K`` suffices. Every ``A⁽ᵏ⁾`` carries a relative slack of 1e-9 against float rounding.

Release. ``r̃ = r(D) + S(D)·(t + σ_s·Z)``, ``Z ~ N(0, 1)``, with ``t = σ_s·Φ⁻¹(confidence) ≥ 0``,
so ``Pr[r̃ ≥ r(D)] = confidence`` (t = 0, confidence ½: the paper's unshifted release). The
shifted value ``r + t·S`` has local sensitivity ≤ ``c·S`` with ``c = 1 + t(e^β − 1)`` (since
``|S(D) − S(D')| ≤ (e^β − 1)·min(S(D), S(D'))``), so this is the GNSS mechanism with bound
``c·S`` and noise ``σ' = σ_s/c``.

GNSS privacy (derived here; Papernot et al. 2018, Thm. 23, state a similar bound). For neighbours
``|f(D) − f(D')| ≤ min(S(D), S(D'))`` and ``r = S(D')/S(D) ∈ [e^{−β}, e^β]``. The Rényi divergence
of ``N(0, σ'²S²)`` from ``N(Δ, σ'²S²r²)`` at order α is
``ln r + ln(r²/(αr² + 1 − α))/(2(α−1)) + αΔ²/(2σ'²S²(αr² + 1 − α))``. The first two terms (two
centred Gaussians) grow with ``|ln r|`` on both sides of 1, so they peak at ``r = e^{±β}``; the
last peaks at ``r = e^{−β}``, ``Δ = S·r``. Hence, when ``(α − 1)(e^{2β} − 1) < 1``, one release is
``(α, ε_ss(α))``-RDP with ``ε_ss(α) = max(V(e^β), V(e^{−β})) + α/(2σ'²(1 − (α−1)(e^{2β} − 1)))``;
swapping D and D' gives the same bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from veil.errors import InvalidParameterError
from veil.mechanisms.rng import RandomSource
from veil.pate.analysis import _log_sf_normal, data_dependent_rdp, log_q_sorted_gaps, log_q_threshold

__all__ = [
    "DataDependentAccount",
    "GnmaxSensitivity",
    "ReleaseParams",
    "gnss_rdp",
    "smooth_sensitivity",
    "threshold_local_sensitivity",
]

# Floor on S: max(S, c) is still a β-smooth upper bound, and keeps the release noisy.
_MIN_SENSITIVITY = 1e-12
# Relative slack on every A^(k): covers float rounding in F and in the running sums.
_SLACK = 1e-9
# Points of the fixed grid in log a (GNMax cells): consecutive |log a| differ by about 0.15%.
_GRID_POINTS = 16000


def _with_slack(a: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    return np.maximum(a, 0.0) * (1.0 + _SLACK) + _SLACK * np.abs(scale)


class _RangeMax:
    """O(1) maximum over index ranges of a fixed array (sparse table)."""

    def __init__(self, values: np.ndarray) -> None:
        self.levels = [np.asarray(values, dtype=np.float64)]
        width = 1
        while 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Max of ``values[lo..hi]`` (inclusive), elementwise; requires ``lo ≤ hi``."""
        span = hi - lo + 1
        level = np.floor(np.log2(span)).astype(np.int64)
        out = np.empty(lo.shape)
        for lv in np.unique(level):
            sel = level == lv
            table = self.levels[int(lv)]
            out[sel] = np.maximum(table[lo[sel]], table[hi[sel] - (1 << int(lv)) + 1])
        return out


class GnmaxSensitivity:
    """``A⁽ᵏ⁾`` of the GNMax data-dependent term (see the module docstring), for one setting.

    The cell table depends only on public parameters (σ, the noise multiplier, the order, the
    number of classes and teachers, the lattice), never on the votes.
    """

    def __init__(
        self,
        sigma: float,
        noise_multiplier: float,
        order: float,
        num_classes: int,
        num_teachers: int,
        lattice: float = 0.0,
    ) -> None:
        self.sigma, self.z, self.order = float(sigma), float(noise_multiplier), float(order)
        self.num_classes, self.num_teachers, self.lattice = int(num_classes), int(num_teachers), lattice
        k, c = self.num_teachers, self.num_classes
        lowest = float(log_q_sorted_gaps(np.full(c - 1, float(k)), sigma, lattice))
        mags = np.geomspace(1e-9, -lowest + 1.0, _GRID_POINTS)
        self.log_a = np.concatenate([-mags[::-1], [0.0]])  # ascending, ends at log a = 0
        f_grid = data_dependent_rdp(self.log_a, self.z, self.order)
        f_psi = data_dependent_rdp(self._log_psi(self.log_a), self.z, self.order)
        # cell 0 = (0, a_0]; cell i ≥ 1 = [a_{i-1}, a_i]: bound F(a_i) − F(ψ(a_{i-1})).
        cells = np.concatenate([[f_grid[0]], f_grid[1:] - f_psi[:-1]])
        self._cells = _with_slack(cells, np.concatenate([[f_grid[0]], f_grid[1:]]))
        self._range_max = _RangeMax(self._cells)

    def _log_psi(self, log_a: np.ndarray) -> np.ndarray:
        """``log ψ(a)``: a lower bound on ``q̃`` at gaps + 2 given ``q̃ = a`` at gaps − 2."""
        s2 = math.sqrt(2.0) * self.sigma
        shift = 3.0 * self.lattice
        tau = np.linspace(0.0, float(self.num_teachers), 4 * self.num_teachers + 1)
        log_rho = _log_sf_normal(tau + 4.0 - shift, s2) - _log_sf_normal(tau - shift, s2)
        log_rest = math.log(self.num_classes - 1) + _log_sf_normal(tau - shift, s2)
        best = np.full(log_a.shape, -np.inf)
        for lr, lt in zip(log_rho, log_rest, strict=True):
            with np.errstate(divide="ignore", invalid="ignore"):
                cand = lr + log_a + np.log(-np.expm1(np.minimum(lt - log_a, 0.0)))
            cand = np.where(log_a > lt, cand, -np.inf)
            best = np.maximum(best, cand)
        return np.minimum(best, 0.0)

    def _cell(self, log_a: np.ndarray) -> np.ndarray:
        """Index of the cell containing ``a`` (cell i covers ``[a_{i-1}, a_i]``)."""
        return np.clip(np.searchsorted(self.log_a, log_a, side="left"), 0, len(self.log_a) - 1)

    def local(self, counts: np.ndarray) -> np.ndarray:
        """``A⁽ᵏ⁾``, k = 0..K, for one histogram (counts in [0, K] summing to at most K: a teacher
        without data abstains; the bound uses only that each count moves by ≤ 1 per changed teacher)."""
        c = np.asarray(counts, dtype=np.float64)
        k_total = self.num_teachers
        s = -np.sort(-c)
        gaps = s[0] - s[1:]
        d = np.arange(0, k_total + 1, dtype=np.float64)[:, None]
        box_lo = np.maximum(gaps[None, :] - 2.0 * d, 0.0)
        box_hi = np.minimum(gaps[None, :] + 2.0 * d, float(k_total))
        log_a_hi = log_q_sorted_gaps(np.maximum(box_lo - 2.0, 0.0), self.sigma, self.lattice)
        log_a_lo = log_q_sorted_gaps(np.maximum(box_hi - 2.0, 0.0), self.sigma, self.lattice)
        lo, hi = self._cell(log_a_lo), self._cell(log_a_hi)
        return self._range_max(lo, np.maximum(hi, lo))


def threshold_local_sensitivity(
    max_counts: np.ndarray | Sequence[int],
    num_teachers: int,
    threshold: float,
    sigma1: float,
    noise_multiplier: float,
    order: float,
    lattice: float = 0.0,
) -> np.ndarray:
    """``A⁽ᵏ⁾``, k = 0..K, of the threshold check's data-dependent term, one row per top count."""
    m = np.asarray(max_counts, dtype=np.int64).reshape(-1)
    k_total = int(num_teachers)
    f = data_dependent_rdp(
        log_q_threshold(np.arange(k_total + 1), threshold, sigma1, lattice)[0], noise_multiplier, order
    )
    steps = _with_slack(np.abs(np.diff(f)), np.maximum(f[1:], f[:-1]))  # |F(j+1) − F(j)|, j = 0..K-1
    if steps.size == 0:
        return np.zeros((m.size, k_total + 1))
    table = _RangeMax(steps)
    k = np.arange(k_total + 1)
    out = np.empty((m.size, k_total + 1))
    for i, mi in enumerate(m):
        lo = np.clip(mi - k - 1, 0, k_total - 1)
        hi = np.clip(mi + k, 0, k_total - 1)
        out[i] = table(lo, np.maximum(hi, lo))
    return out


def smooth_sensitivity(local: np.ndarray, beta: float) -> float:
    """``max_k e^{−βk}·A⁽ᵏ⁾`` (at least a tiny floor), for ``A`` indexed by k = 0, 1, …"""
    if not (beta > 0 and math.isfinite(beta)):
        raise InvalidParameterError("smooth_beta", beta, "smoothness must be a finite β > 0", "pass β > 0")
    a = np.asarray(local, dtype=np.float64)
    weights = np.exp(-beta * np.arange(a.size))
    return max(float(np.max(weights * a)) if a.size else 0.0, _MIN_SENSITIVITY)


def _centred_divergence(alpha: np.ndarray, log_r: float) -> np.ndarray:
    """``D_α(N(0,1) ‖ N(0, r²))`` with ``r = e^{log_r}`` (inf where ``αr² + 1 − α ≤ 0``)."""
    r2 = math.exp(2.0 * log_r)
    den = alpha * r2 + 1.0 - alpha
    with np.errstate(divide="ignore", invalid="ignore"):
        val = log_r + (2.0 * log_r - np.log(np.where(den > 0, den, 1.0))) / (2.0 * (alpha - 1.0))
    return np.where(den > 0, val, np.inf)


def gnss_rdp(orders: Sequence[float] | np.ndarray | float, beta: float, sigma_s: float) -> np.ndarray:
    """RDP of one GNSS release with smoothness β and noise ``σ_s`` at each order (inf where invalid)."""
    if not (beta > 0 and math.isfinite(beta)):
        raise InvalidParameterError("smooth_beta", beta, "smoothness must be a finite β > 0", "pass β > 0")
    if not (sigma_s > 0 and math.isfinite(sigma_s)):
        raise InvalidParameterError(
            "smooth_sigma", sigma_s, "the release noise must be finite and > 0", "pass σ_s > 0"
        )
    a = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    shrink = 1.0 - (a - 1.0) * math.expm1(2.0 * beta)
    ok = shrink > 0
    mean = a / (2.0 * sigma_s**2 * np.where(ok, shrink, 1.0))
    var = np.maximum(_centred_divergence(a, beta), _centred_divergence(a, -beta))
    out = np.where(ok, var + mean, np.inf)
    return np.asarray(np.nextafter(out, np.inf))  # rounded up


@dataclass(frozen=True)
class ReleaseParams:
    """Public parameters of the data-dependent release: order λ, smoothness β, noise σ_s, confidence."""

    order: float
    beta: float
    sigma_s: float
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not (self.order > 1 and math.isfinite(self.order)):
            raise InvalidParameterError("order", self.order, "Rényi orders are > 1", "pass λ > 1")
        if not (0.5 <= self.confidence < 1):
            raise InvalidParameterError(
                "dd_confidence",
                self.confidence,
                "the released bound exceeds the true data-dependent cost with this probability; below "
                "½ it would understate it more often than not",
                "pass a confidence in [0.5, 1)",
            )
        if not np.isfinite(gnss_rdp(self.order, self.beta, self.sigma_s))[0]:
            raise InvalidParameterError(
                "smooth_beta",
                self.beta,
                f"the release has no RDP bound at order λ={self.order:g} unless (λ − 1)(e^(2β) − 1) < 1",
                f"pass β < {0.5 * math.log1p(1.0 / (self.order - 1.0)):.4g}, or a lower order",
            )

    @property
    def shift(self) -> float:
        """``t = σ_s·Φ⁻¹(confidence)``."""
        from scipy.stats import norm

        return float(self.sigma_s * norm.ppf(self.confidence))

    @property
    def effective_sigma(self) -> float:
        """``σ' = σ_s/(1 + t(e^β − 1))``: the noise relative to the smooth bound of the shifted value."""
        return self.sigma_s / (1.0 + self.shift * math.expm1(self.beta))

    def rdp(self, orders: Sequence[float] | np.ndarray | float) -> np.ndarray:
        """RDP of one release at each order (inf where the GNSS bound does not hold)."""
        return gnss_rdp(orders, self.beta, self.effective_sigma)


@dataclass
class DataDependentAccount:
    """The running data-dependent RDP ``r(D)`` at one order, its ``A⁽ᵏ⁾``, and its private release.

    ``add_gnmax``/``add_threshold`` record one mechanism use on a vote histogram. ``value`` and
    ``local`` depend on the private votes: publish nothing from here except :meth:`release`.
    """

    num_teachers: int
    num_classes: int
    params: ReleaseParams
    value: float = 0.0
    releases: int = 0
    local: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.local = np.zeros(self.num_teachers + 1)
        self._gn: dict[tuple[float, float, float], GnmaxSensitivity] = {}

    def add_gnmax(
        self, counts: np.ndarray, sigma: float, noise_multiplier: float, lattice: float = 0.0
    ) -> float:
        """Record one GNMax answer on the histogram ``counts``; returns its data-dependent RDP."""
        c = np.asarray(counts, dtype=np.float64)
        s = -np.sort(-c)
        lq = log_q_sorted_gaps(s[0] - s[1:], sigma, lattice)
        r = float(data_dependent_rdp(lq, noise_multiplier, self.params.order))
        key = (float(sigma), float(noise_multiplier), float(lattice))
        if key not in self._gn:
            self._gn[key] = GnmaxSensitivity(
                sigma, noise_multiplier, self.params.order, self.num_classes, self.num_teachers, lattice
            )
        self.value += r
        self.local += self._gn[key].local(c)
        return r

    def add_threshold(
        self, max_count: int, threshold: float, sigma1: float, noise_multiplier: float, lattice: float = 0.0
    ) -> float:
        """Record one threshold check on a histogram with top count ``max_count``; returns its RDP."""
        lq = log_q_threshold(float(max_count), threshold, sigma1, lattice)[0]
        r = float(data_dependent_rdp(lq, noise_multiplier, self.params.order))
        self.value += r
        self.local += threshold_local_sensitivity(
            [max_count], self.num_teachers, threshold, sigma1, noise_multiplier, self.params.order, lattice
        )[0]
        return r

    def smooth_sensitivity(self) -> float:
        """``S(D)`` for the current sum (private: never publish it)."""
        return smooth_sensitivity(self.local * (1.0 + _SLACK), self.params.beta)

    def release(self, rng: RandomSource) -> float:
        """``r̃ = r(D) + S(D)·(t + σ_s·Z)``; each call costs :meth:`ReleaseParams.rdp` once."""
        z = float(rng.standard_normal(1)[0])
        self.releases += 1
        noisy = self.value + self.smooth_sensitivity() * (self.params.shift + self.params.sigma_s * z)
        if rng.secure:  # a coarse public grid: no float-level trace of S(D) in the output
            noisy = math.ceil(noisy * 2.0**20) / 2.0**20
        return noisy
