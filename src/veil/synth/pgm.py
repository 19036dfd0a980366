"""Graphical-model estimation from noisy marginals (the Private-PGM approach), on numpy/scipy.

Given noisy measurements ``y_r = M_r(D) + noise`` of marginals over attribute cliques ``r``, find the
distribution ``p`` in the exponential family of a junction tree that contains every ``r`` and
minimises ``L(μ) = ½ Σ_r Σ_cells w_r (μ_r − y_r)²`` (``w_r = 1/σ_r²``: the Gaussian log-likelihood),
where ``μ_r = N̂·p(r)``. This is a convex problem over the marginal polytope, solved by entropic
mirror descent on the cliques' log-potentials θ with an Armijo line search (McKenna, Sheldon &
Miklau 2019). Each step runs exact sum-product belief propagation on the junction tree (log space).

Everything here reads only the noisy measurements and public structure: it is post-processing, and
costs no privacy. Sampling draws rows clique by clique along the tree, each group of rows that agree
on the separator getting its conditional distribution's counts rounded systematically (fewer
sampling errors than independent draws), from the run's random source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from veil.mechanisms.rng import RandomSource
from veil.synth.junction import Clique, JunctionTree, junction_tree

__all__ = ["GraphicalModel", "Measurement", "estimate", "marginal_counts"]


@dataclass
class Measurement:
    """A noisy marginal: counts ``y`` over ``attrs`` (sorted), cell weights ``w = 1/variance``."""

    attrs: Clique
    y: np.ndarray
    weight: np.ndarray
    sigma: float
    """The noise std of one cell of the original measurement (reports)."""


def marginal_counts(
    codes: np.ndarray, sizes: Sequence[int], attrs: Clique, weights: np.ndarray | None = None
) -> np.ndarray:
    """The exact count table of ``attrs`` (shape: their sizes) over the rows of ``codes``.

    ``weights``: one per row (privacy units: ``1/n_u`` for each of unit ``u``'s rows, so a unit adds
    at most 1 to the table in L1, as one row does; see :mod:`veil.synth.units`)."""
    dims = tuple(sizes[a] for a in attrs)
    if not attrs:
        return np.array(float(codes.shape[0] if weights is None else weights.sum()))
    flat = np.ravel_multi_index(tuple(codes[:, a] for a in attrs), dims)
    counts = np.bincount(flat, weights=weights, minlength=math.prod(dims))
    return counts.astype(np.float64).reshape(dims)


def logsumexp(arr: np.ndarray, axis: int | tuple[int, ...] | None = None) -> np.ndarray:
    """log Σ exp over ``axis`` (numpy only: scipy's array-API wrapper costs more than the sum here)."""
    top = np.max(arr, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    out = np.log(np.sum(np.exp(arr - top), axis=axis, keepdims=True)) + top
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())


def _expand(arr: np.ndarray, attrs: Clique, target: Clique, sizes: Sequence[int]) -> np.ndarray:
    """``arr`` over ``attrs`` reshaped to broadcast over ``target`` (``attrs ⊆ target``, both sorted)."""
    return arr.reshape([sizes[a] if a in attrs else 1 for a in target])


def _reduce(arr: np.ndarray, attrs: Clique, keep: Clique, *, log: bool) -> np.ndarray:
    axes = tuple(i for i, a in enumerate(attrs) if a not in keep)
    if not axes:
        return arr
    return logsumexp(arr, axis=axes) if log else arr.sum(axis=axes)


class GraphicalModel:
    """p(x) ∝ exp(Σ_C θ_C(x_C)) over the cliques of a junction tree; ``total`` rows (N̂)."""

    def __init__(self, sizes: Sequence[int], cliques: Sequence[Clique], total: float) -> None:
        self.sizes = tuple(sizes)
        self.tree: JunctionTree = junction_tree(len(self.sizes), cliques, self.sizes)
        self.theta = [np.zeros([self.sizes[a] for a in c]) for c in self.tree.cliques]
        self.total = float(total)
        self._beliefs: list[np.ndarray] | None = None
        self._nbrs: dict[int, list[int]] = {i: [] for i in range(len(self.tree.cliques))}
        self._seps: dict[tuple[int, int], Clique] = {}
        for p, c in self.tree.order:
            self._nbrs[p].append(c)
            self._nbrs[c].append(p)
            self._seps[(p, c)] = self._seps[(c, p)] = self.tree.separator(p, c)

    def warm_start(self, other: GraphicalModel) -> None:
        """Copy the potentials of a smaller model onto this one's cliques (AIM's rounds)."""
        for c_old, t_old in zip(other.tree.cliques, other.theta, strict=True):
            i = self.tree.containing(c_old)
            if i is None:  # a fill-in clique the new triangulation does not keep: start it from zero
                continue
            self.theta[i] = self.theta[i] + _expand(t_old, c_old, self.tree.cliques[i], self.sizes)
        self._beliefs = None

    # -- inference -----------------------------------------------------------------------------
    def set_theta(self, theta: list[np.ndarray]) -> None:
        self.theta = theta
        self._beliefs = None

    def beliefs(self) -> list[np.ndarray]:
        """Log-probabilities of every clique's marginal (calibrated by sum-product)."""
        if self._beliefs is None:
            self._beliefs = self._propagate(self.theta)
        return self._beliefs

    def _propagate(self, theta: list[np.ndarray]) -> list[np.ndarray]:
        tree, sizes = self.tree, self.sizes
        cl = tree.cliques
        nbrs = self._nbrs
        msgs: dict[tuple[int, int], np.ndarray] = {}

        def send(a: int, b: int) -> None:
            sep = self._seps[(a, b)]
            acc = theta[a]
            for k in nbrs[a]:
                if k != b and (k, a) in msgs:
                    acc = acc + msgs[(k, a)]
            msgs[(a, b)] = _expand(_reduce(acc, cl[a], sep, log=True), sep, cl[b], sizes)

        for p, c in reversed(tree.order):
            send(c, p)
        for p, c in tree.order:
            send(p, c)
        out = []
        for i in range(len(cl)):
            b = theta[i]
            for k in nbrs[i]:
                b = b + msgs[(k, i)]
            out.append(b - logsumexp(b))
        return out

    def clique_marginals(self) -> list[np.ndarray]:
        """Expected counts (N̂·p) of every junction-tree clique."""
        return [self.total * np.exp(b) for b in self.beliefs()]

    def marginal(self, attrs: Clique) -> np.ndarray:
        """Expected counts of any attribute set: from a clique, else by variable elimination."""
        attrs = tuple(sorted(attrs))
        i = self.tree.containing(attrs)
        if i is not None:
            return self.total * _reduce(np.exp(self.beliefs()[i]), self.tree.cliques[i], attrs, log=False)
        logp = self._eliminate(attrs)
        return self.total * np.exp(logp - logsumexp(logp))

    def _union_size(self, v: int, factors: list[tuple[Clique, np.ndarray]]) -> int:
        return math.prod(self.sizes[a] for a in {a for c, _ in factors if v in c for a in c})

    def _eliminate(self, keep: Clique) -> np.ndarray:
        factors = [(c, t) for c, t in zip(self.tree.cliques, self.theta, strict=True)]
        todo = {a for c in self.tree.cliques for a in c} - set(keep)
        while todo:
            current = factors
            v = min(todo, key=lambda u: self._union_size(u, current))
            todo.discard(v)
            hit = [(c, t) for c, t in factors if v in c]
            factors = [(c, t) for c, t in factors if v not in c]
            union = tuple(sorted({a for c, _ in hit for a in c}))
            acc = sum((_expand(t, c, union, self.sizes) for c, t in hit), np.zeros([1] * len(union)))
            acc = np.broadcast_to(acc, [self.sizes[a] for a in union])
            rest = tuple(a for a in union if a != v)
            factors.append((rest, _reduce(np.asarray(acc), union, rest, log=True)))
        acc = np.zeros([self.sizes[a] for a in keep])
        for c, t in factors:
            acc = acc + _expand(t, c, keep, self.sizes)
        return acc

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, rows: int, rng: RandomSource) -> np.ndarray:
        """``rows`` records (codes, rows × attributes) drawn from the model along the tree."""
        out = np.zeros((rows, len(self.sizes)), dtype=np.int64)
        cl = self.tree.cliques
        probs = [np.exp(b) for b in self.beliefs()]
        _fill(out, (), cl[0], probs[0], self.sizes, rng)
        for p, c in self.tree.order:
            _fill(out, self.tree.separator(p, c), cl[c], probs[c], self.sizes, rng)
        return out


def _fill(
    out: np.ndarray, sep: Clique, clique: Clique, prob: np.ndarray, sizes: Sequence[int], rng: RandomSource
) -> None:
    """Draw the attributes ``clique \\ sep`` of every row, given the row's values on ``sep``."""
    new = tuple(a for a in clique if a not in sep)
    if not new:
        return
    rows = out.shape[0]
    order_axes = [clique.index(a) for a in sep] + [clique.index(a) for a in new]
    table = np.transpose(prob, order_axes)
    g = math.prod(sizes[a] for a in sep)
    k = math.prod(sizes[a] for a in new)
    cond = table.reshape(g, k)
    cond = cond / np.maximum(cond.sum(axis=1, keepdims=True), 1e-300)
    cond[cond.sum(axis=1) == 0] = 1.0 / k
    if sep:
        group = np.ravel_multi_index(tuple(out[:, a] for a in sep), [sizes[a] for a in sep])
    else:
        group = np.zeros(rows, np.int64)
    counts = np.bincount(group, minlength=g).astype(np.float64)
    expected = counts[:, None] * cond
    whole = np.floor(expected)
    frac = expected - whole
    # Systematic rounding within each group: one uniform offset, cells picked where the running sum
    # of the fractional parts crosses an integer; each cell's inclusion probability is its fraction.
    offset = rng.uniform(g)[:, None]
    cum = np.cumsum(frac, axis=1)
    prev = np.concatenate([np.zeros((g, 1)), cum[:, :-1]], axis=1)
    picked = np.floor(cum - offset) - np.floor(prev - offset)
    cell_counts = (whole + np.clip(picked, 0, 1)).astype(np.int64)
    # Guard the total of each group against rounding at the edges.
    diff = counts.astype(np.int64) - cell_counts.sum(axis=1)
    if np.any(diff != 0):
        top = np.argmax(cond, axis=1)
        cell_counts[np.arange(g), top] += diff
        cell_counts = np.maximum(cell_counts, 0)
    values = np.repeat(np.tile(np.arange(k), g), cell_counts.ravel())
    key = rng.uniform(rows)
    order = np.lexsort((key, group))
    new_codes = np.unravel_index(values[:rows], [sizes[a] for a in new])
    for a, v in zip(new, new_codes, strict=True):
        out[order, a] = v


def estimate(
    sizes: Sequence[int],
    measurements: Sequence[Measurement],
    total: float,
    *,
    iterations: int,
    extra_cliques: Sequence[Clique] = (),
    warm: GraphicalModel | None = None,
) -> GraphicalModel:
    """The model that best fits the measurements (mirror descent, ``iterations`` steps)."""
    cliques = [m.attrs for m in measurements] + list(extra_cliques)
    model = GraphicalModel(sizes, cliques, total)
    if warm is not None:
        model.warm_start(warm)
    cl = model.tree.cliques
    where = []
    for m in measurements:
        i = model.tree.containing(m.attrs)
        assert i is not None
        where.append(i)

    def loss_grad(mus: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        loss = 0.0
        grads = [np.zeros_like(t) for t in model.theta]
        for m, i in zip(measurements, where, strict=True):
            mu = _reduce(mus[i], cl[i], m.attrs, log=False)
            diff = mu - m.y
            loss += 0.5 * float(np.sum(m.weight * diff * diff))
            grads[i] = grads[i] + _expand(m.weight * diff, m.attrs, cl[i], sizes)
        return loss, grads

    w_max = max(float(np.max(m.weight)) for m in measurements)
    alpha = 1.0 / (max(total, 1.0) * w_max)
    mus = model.clique_marginals()
    loss, grads = loss_grad(mus)
    for _ in range(iterations):
        theta0, mus0 = model.theta, mus
        alpha *= 2.0
        for _ in range(30):
            model.set_theta([t - alpha * g for t, g in zip(theta0, grads, strict=True)])
            mus = model.clique_marginals()
            new_loss, new_grads = loss_grad(mus)
            gain = sum(float(np.sum(g * (a - b))) for g, a, b in zip(grads, mus0, mus, strict=True))
            if loss - new_loss >= 0.5 * alpha * gain:
                break
            alpha *= 0.5
        loss, grads = new_loss, new_grads
    return model
