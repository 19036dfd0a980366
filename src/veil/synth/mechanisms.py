"""MST and AIM: which marginals to measure, with how much of the zCDP budget ρ, then the model.

Both take integer codes (rows × attributes), the public domain sizes, a budget ρ and a random
source, and return a :class:`SynthFit`: synthetic codes and every privacy event, in order.

* **MST** (McKenna, Miklau & Sheldon 2021): ρ/3 measures every 1-way marginal; rare levels are
  merged (post-processing); ρ/3 selects the d − 1 edges of a maximum spanning tree of the 2-way
  marginals, each edge one exponential-mechanism selection among the pairs that join two components
  (score: the L1 distance between the pair's data marginal and the independent model's, sensitivity
  1); ρ/3 measures the selected 2-way marginals. The model is fitted to all measurements.
* **AIM** (McKenna, Mullins, Sheldon & Miklau 2022): 1-way marginals first, then rounds that each
  select a marginal of the workload's downward closure with the exponential mechanism (score
  ``w_r·(‖M_r(D) − M_r(p̂)‖₁ − √(2/π)·σ·n_r)``, sensitivity ``max w_r``), measure it, refit, and
  halve σ (double ε) when a measurement barely moved the model, until ρ is spent. Candidates whose
  model would exceed ``max_cells·ρ_used/ρ`` cells (ρ_used: this round's share included) are not
  offered (a public rule). The model's row count N̂ is re-estimated from all measurements so far.

The scores read the data only through marginals with sensitivity stated above, computed in float64
and summed with ``math.fsum`` (the float margin of :mod:`veil.mechanisms.exponential`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from veil.accounting.events import PrivacyEvent
from veil.mechanisms.rng import RandomSource
from veil.synth.compress import compress
from veil.synth.junction import Clique, model_cells
from veil.synth.measure import Spend, l1, measure, select
from veil.synth.pgm import GraphicalModel, Measurement, estimate, marginal_counts

__all__ = ["SynthFit", "aim", "mst", "workload_cliques"]

Progress = Callable[[str], None]
OnEvent = Callable[[str, PrivacyEvent], None]


@dataclass
class SynthFit:
    """What a mechanism produced: synthetic codes, its events and what it measured."""

    codes: np.ndarray
    spend: Spend
    measured: list[tuple[Clique, float, int]] = field(default_factory=list)
    """(clique, noise std per count, cells measured) of every measurement, in order."""
    model: GraphicalModel | None = None
    total: float = 0.0


def _total(measurements: Sequence[Measurement]) -> float:
    """N̂: the inverse-variance average of the measurements' noisy sums (at least 1).

    Each measurement's cells sum to N plus noise of variance Σ 1/w; the minimum-variance unbiased
    combination weighs each sum by its inverse variance. AIM recomputes it after every measurement, so
    later, less noisy marginals sharpen the total the model is fitted to (post-processing)."""
    est = [(float(m.y.sum()), float(np.sum(1.0 / m.weight))) for m in measurements]
    w = [1.0 / v for _, v in est]
    return max(1.0, sum(s * wi for (s, _), wi in zip(est, w, strict=True)) / sum(w))


def _round_cost(sigma: float, eps: float) -> float:
    """ρ (zCDP) of one AIM round: the Gaussian measurement (1/(2σ²)) and the selection (ε²/8)."""
    return 1 / (2 * sigma**2) + eps**2 / 8


def _simplex(y: np.ndarray, total: float) -> np.ndarray:
    """The closest (L2) non-negative vector summing to ``total``: the independent model's 1-way fit."""
    u = np.sort(y)[::-1]
    css = np.cumsum(u) - total
    k = np.arange(1, y.size + 1)
    rho = int(np.nonzero(u - css / k > 0)[0][-1])
    return np.maximum(y - css[rho] / (rho + 1), 0.0)


def mst(
    codes: np.ndarray,
    sizes: tuple[int, ...],
    rho: float,
    rng: RandomSource,
    names: Sequence[str],
    *,
    rows: int,
    iterations: int = 1000,
    progress: Progress | None = None,
    on_event: OnEvent | None = None,
    weights: np.ndarray | None = None,
) -> SynthFit:
    d = len(sizes)
    spend = Spend(rho, on_event)
    parts = 3 if d > 1 else 1
    sigma1 = math.sqrt(parts * d / (2 * rho))
    one = [measure(codes, sizes, (i,), sigma1, rng, spend, names, weights) for i in range(d)]
    comp = compress(one, sizes)
    ccodes = comp.apply(codes)
    csizes = comp.sizes
    measurements = [comp.measurement(i, m) for i, m in enumerate(one)]
    total = _total(measurements)
    measured: list[tuple[Clique, float, int]] = [((i,), m.sigma, m.y.size) for i, m in enumerate(one)]
    if d > 1:
        eps = math.sqrt(8 * (rho / 3) / (d - 1))
        one_way = [_simplex(m.y, total) for m in measurements]
        pairs = list(itertools.combinations(range(d), 2))
        score = {
            (i, j): l1(
                marginal_counts(ccodes, csizes, (i, j), weights), np.outer(one_way[i], one_way[j]) / total
            )
            for i, j in pairs
        }
        comp_of = list(range(d))

        def find(i: int) -> int:
            while comp_of[i] != i:
                i = comp_of[i]
            return i

        chosen: list[Clique] = []
        for _ in range(d - 1):
            cand = [p for p in pairs if find(p[0]) != find(p[1])]
            k = select([score[p] for p in cand], eps, 1.0, rng, spend, "select tree edge")
            a, b = cand[k]
            comp_of[find(a)] = find(b)
            chosen.append(cand[k])
        sigma2 = math.sqrt(3 * (d - 1) / (2 * rho))
        for p in chosen:
            m = measure(ccodes, csizes, p, sigma2, rng, spend, names, weights)
            measurements.append(m)
            measured.append((p, m.sigma, m.y.size))
        if progress:
            progress("fitting the model")
    total = _total(measurements)
    model = estimate(csizes, measurements, total, iterations=iterations)
    synthetic = comp.restore(model.sample(rows, rng), rng)
    return SynthFit(synthetic, spend, measured, model, total)


def workload_cliques(d: int, degree: int) -> list[Clique]:
    """All marginals of ``degree`` attributes (fewer when there are fewer attributes)."""
    return list(itertools.combinations(range(d), min(degree, d)))


def _closure(workload: Sequence[Clique]) -> dict[Clique, float]:
    """The downward closure of the workload, each clique with its AIM weight Σ_s |r ∩ s|."""
    out: dict[Clique, float] = {}
    for s in workload:
        for k in range(1, len(s) + 1):
            for r in itertools.combinations(s, k):
                out.setdefault(r, 0.0)
    for r in out:
        out[r] = float(sum(len(set(r) & set(s)) for s in workload))
    return out


def aim(
    codes: np.ndarray,
    sizes: tuple[int, ...],
    rho: float,
    rng: RandomSource,
    names: Sequence[str],
    *,
    rows: int,
    workload: Sequence[Clique],
    max_cells: int,
    iterations: int = 1000,
    round_iterations: int = 100,
    progress: Progress | None = None,
    on_event: OnEvent | None = None,
    weights: np.ndarray | None = None,
) -> SynthFit:
    d = len(sizes)
    spend = Spend(rho, on_event)
    rounds = 16 * d
    alpha = 0.9
    sigma = math.sqrt(rounds / (2 * alpha * rho))
    eps = math.sqrt(8 * (1 - alpha) * rho / rounds)
    measurements = [measure(codes, sizes, (i,), sigma, rng, spend, names, weights) for i in range(d)]
    measured: list[tuple[Clique, float, int]] = [
        ((i,), m.sigma, m.y.size) for i, m in enumerate(measurements)
    ]
    total = _total(measurements)
    model = estimate(sizes, measurements, total, iterations=round_iterations)
    candidates = _closure(workload)
    data_marginals: dict[Clique, np.ndarray] = {}
    terminate = False
    t = 0
    while not terminate:
        t += 1
        remaining = spend.remaining
        if remaining < 2 * _round_cost(sigma, eps) * (1 + 1e-9):
            sigma = math.sqrt(1 / (2 * alpha * remaining)) * (1 + 1e-9)
            eps = math.sqrt(8 * (1 - alpha) * remaining) * (1 - 1e-9)
            terminate = True
        # The size limit grows with the budget used, this round's included (the paper's ρ_used).
        limit = max_cells * min(1.0, (rho - remaining + _round_cost(sigma, eps)) / rho)
        cliques = [m.attrs for m in measurements]
        offered = [r for r in candidates if model_cells(d, [*cliques, r], sizes) <= limit]
        if not offered:
            offered = [m.attrs for m in measurements if len(m.attrs) == 1]
        scores = []
        for r in offered:
            if r not in data_marginals:
                data_marginals[r] = marginal_counts(codes, sizes, r, weights)
            bias = math.sqrt(2 / math.pi) * sigma * data_marginals[r].size
            scores.append(candidates.get(r, 1.0) * (l1(data_marginals[r], model.marginal(r)) - bias))
        sens = max(candidates.get(r, 1.0) for r in offered)
        r = offered[select(scores, eps, sens, rng, spend, f"select marginal (round {t})")]
        m = measure(codes, sizes, r, sigma, rng, spend, names, weights)
        measurements.append(m)
        measured.append((r, m.sigma, m.y.size))
        before = model.marginal(r)
        total = _total(measurements)
        model = estimate(sizes, measurements, total, iterations=round_iterations, warm=model)
        if progress:
            progress(f"round {t}: measured {' × '.join(names[a] for a in r)}")
        if l1(model.marginal(r), before) <= math.sqrt(2 / math.pi) * sigma * before.size:
            sigma /= 2
            eps *= 2
    model = estimate(sizes, measurements, total, iterations=iterations, warm=model)
    return SynthFit(model.sample(rows, rng), spend, measured, model, total)
