"""DP whitening of a fixed front's rows by a released Gram matrix (the ``image-scatternet`` preset).

What it does. The head of the scattering preset is one linear layer trained by DP-SGD on rows ``z``
of norm ≤ 1 (:class:`veil.models.scattering.UnitRows`: a public per-record rule). Before the first
step, one Gaussian release ``G̃ = Σ z zᵀ + N`` is made; ``P = (max(G̃, 0)/n + λI)^(-1/2)`` and a
scale ``c`` are computed from it (post-processing), and DP-SGD trains on the rows ``c·z P``. At the
end ``P`` and ``c`` are folded into the layer (``W' = c·W·P``, :func:`fold_`), so the released model
acts on ``z`` and carries no ``d × d`` matrix. Measured on Fashion-MNIST at ε = 3: +0.7 points
(docs/benchmarks.md, eighth session).

Guarantee. Under add/remove-one neighbouring, one example adds ``z zᵀ`` to the sum; the vector of
its upper triangle (diagonal included) has squared L2 norm ``Σᵢ zᵢ⁴ + Σᵢ<ⱼ zᵢ²zⱼ² ≤ ‖z‖⁴ ≤ 1``,
so the upper triangle has L2 sensitivity 1 (rows of norm above 1 are scaled down to 1 here as
well, a per-record rule that never acts on :class:`UnitRows`' output). Every upper-triangle
coordinate gets one independent ``N(0, S²)`` draw, mirrored to the lower triangle (the lower
triangle is a copy: post-processing), and the noisy values are rounded to the power-of-two grid
of :func:`veil.optimizer.release_grid` (as a DP-SGD step's release, and for the same reason). The
release is therefore the event ``Gaussian(S)``, composed *before* the steps (``Prepared.pre_events``:
the steps' σ is calibrated for what remains of ε). Noise comes from the run's private source: the
OS CSPRNG in secure mode (the default), a derived seed only in ``--reproducible`` research runs.
``n`` (the number of training rows) is treated as public, as in DP-SGD's ``q = B/N``.

Why ``eigh`` (the symmetric root) and not a Cholesky factor: ``max(G̃, 0)`` needs the eigenvalues
(noise makes some negative), and the symmetric root is what the bench measured; a Cholesky factor
would train the same model up to a rotation of the rows only when ``λ`` keeps ``G̃/n + λI`` positive
definite. One float64 ``eigh`` of ``d × d`` (d = 5,735 for Fashion-MNIST) takes about a minute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from veil.accounting.events import Gaussian

if TYPE_CHECKING:
    from torch import nn

    from veil.mechanisms.rng import RandomSource

__all__ = [
    "WhiteningPlan",
    "fold_",
    "gram_of_rows",
    "release_gram",
    "whiten_rows_",
    "whitener",
]

GRAM_CHUNK = 2048
"""Rows per chunk of the Gram matrix's accumulation (float64 d × d sum, float32 chunk products)."""


@dataclass
class WhiteningPlan:
    """The planned release: noise std ``std`` (S) per Gram coordinate (sensitivity 1), ridge ``λ``,
    and the rows' target root-mean-square norm after whitening (``row_norm``: the scale the preset's
    learning rate and clipping norm were tuned at)."""

    std: float
    ridge: float
    row_norm: float

    @property
    def event(self) -> Gaussian:
        return Gaussian(self.std)


def gram_of_rows(rows: np.ndarray, chunk: int = GRAM_CHUNK) -> np.ndarray:
    """``Σ z zᵀ`` over the rows (float64 accumulation of float32 chunk products), each row first scaled
    down to norm ≤ 1 if above it (a per-record rule: the release's sensitivity bound)."""
    import torch

    d = rows.shape[1]
    total = np.zeros((d, d), dtype=np.float64)
    part = torch.empty(d, d, dtype=torch.float32)  # one chunk's product, reused
    for i in range(0, len(rows), chunk):
        z = torch.from_numpy(np.ascontiguousarray(rows[i : i + chunk], dtype=np.float32))
        norms = z.double().norm(dim=1, keepdim=True)
        z = z * (1.0 / norms.clamp_min(1.0)).float()
        torch.mm(z.T, z, out=part)
        np.add(total, part.numpy(), out=total)  # numpy casts chunk-wise: no d × d float64 temporary
    return total


def release_gram(rows: np.ndarray, std: float, rng: RandomSource) -> np.ndarray:
    """The released ``G̃`` (float32, symmetric): :func:`gram_of_rows` plus one ``N(0, std²)`` draw per
    upper-triangle coordinate, mirrored, rounded to the release grid (module docstring: the event is
    ``Gaussian(std)``). Call only after that event is charged."""
    import torch

    from veil.optimizer import release_grid

    gram = gram_of_rows(rows)
    d = len(gram)
    noise = rng.normal((d * (d + 1) // 2,), std, dtype=torch.float64).numpy()
    start = 0
    for i in range(d):  # row i's upper part gets its own draws; the column below the diagonal mirrors it
        gram[i, i:] += noise[start : start + d - i]
        gram[i + 1 :, i] = gram[i, i + 1 :]
        start += d - i
    del noise
    grid = release_grid(std)  # in place: no d × d temporaries (a power of two: × and ÷ are exact)
    gram /= grid
    np.rint(gram, out=gram)
    gram *= grid
    return gram.astype(np.float32)


def whitener(gram: np.ndarray, n: int, ridge: float, row_norm: float) -> tuple[np.ndarray, float]:
    """``(P, c)`` from a released Gram matrix (post-processing): ``P = (max(G̃, 0)/n + λI)^(-1/2)``
    (float32, symmetric) and ``c`` such that ``c·zP`` has root-mean-square norm ``row_norm`` by the
    released estimate ``tr(P G̃₊ P)/n`` (eigenvalues the noise made negative taken as 0)."""
    vals, vecs = np.linalg.eigh(gram.astype(np.float64))
    spectrum = np.maximum(vals, 0.0) / n
    root = 1.0 / np.sqrt(spectrum + ridge)
    mean_square = float(np.sum(root * root * spectrum))
    c = row_norm / math.sqrt(max(mean_square, 1e-300))
    vecs *= np.sqrt(root)  # in place: V·diag(√root), so P = (V·diag(√root))(V·diag(√root))ᵀ, symmetric
    return (vecs @ vecs.T).astype(np.float32), c


def whiten_rows_(rows: np.ndarray, p: np.ndarray, c: float, chunk: int = 4096) -> None:
    """``rows ← c·rows·P`` in place, chunk by chunk (no second copy of the rows)."""
    import torch

    pt = torch.from_numpy(np.ascontiguousarray(p, dtype=np.float32))
    for i in range(0, len(rows), chunk):
        part = torch.from_numpy(rows[i : i + chunk])
        part.copy_((part @ pt).mul_(c))


def fold_(linear: nn.Module, p: np.ndarray, c: float) -> None:
    """``W ← c·W·P`` in place: the layer trained on ``c·zP`` now acts on ``z`` (``P`` symmetric; the
    bias unchanged)."""
    import torch

    if not isinstance(linear, torch.nn.Linear):
        raise TypeError(f"the whitening folds into a linear layer, got {type(linear).__name__}")
    with torch.no_grad():
        pt = torch.from_numpy(np.ascontiguousarray(p)).to(linear.weight.dtype)
        linear.weight.copy_((linear.weight @ pt) * c)
