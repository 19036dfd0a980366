"""DP whitening of a fixed front's rows by a released Gram matrix (the ``image-scatternet`` preset).

What it does. The head of the scattering preset is one linear layer trained by DP-SGD on rows ``z``
of norm ≤ 1 (:class:`veil.models.scattering.UnitRows`: a public per-record rule). Before the first
step, one Gaussian release ``G̃ = Σ z zᵀ + N`` is made; ``P = (max(G̃, 0)/n + λI)^(-1/2)`` is computed
from it (post-processing), and DP-SGD trains on the rows ``zP`` each rescaled to norm ``row_norm``
(:class:`veil.models.scattering.WhitenedRows`, a public per-record rule once ``P`` is released). The
released model applies the same map at prediction time, so it carries ``P`` (``d × d`` float32: 131.5
MB for Fashion-MNIST's d = 5,734). Measured on Fashion-MNIST at ε = 3: +0.7 points over the preset
without it (docs/benchmarks.md, eighth session); one global scale of ``zP`` instead of the per-row
norm loses that gain (ninth session).

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
``n`` is a public count, as in DP-SGD's ``q = B/N``: the job's planned size
(``Prepared.n_planned``: N for ``veil train``, never a private part's own count).

Why an eigendecomposition (the symmetric root) and not a Cholesky factor: ``max(G̃, 0)`` needs the
eigenvalues (noise makes some negative), and the symmetric root is what the bench measured.

Memory. The eigendecomposition is LAPACK's MRRR driver (``syevr``) on a float64 copy that it
overwrites: two ``d × d`` float64 arrays at the peak (526 MB for d = 5,734), against four for
``numpy.linalg.eigh`` (its input copy and ``syevd``'s ``2d²`` workspace). It takes about a minute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from veil.accounting.events import Gaussian

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.mechanisms.rng import RandomSource

__all__ = [
    "WhiteningPlan",
    "eigh_ready",
    "gram_of_rows",
    "release_gram",
    "whiten_rows_",
    "whitener",
]

GRAM_CHUNK = 2048
"""Rows per chunk of the Gram matrix's accumulation (float64 d × d sum, float32 chunk products)."""

NOISE_BLOCK = 2**20
"""Gram noise values per draw (8 MiB in float64): the ``d(d+1)/2`` upper-triangle draws are made in
blocks of whole rows, so the noise and its transform's temporaries never take ``d²``-sized memory."""


@dataclass
class WhiteningPlan:
    """The planned release: noise std ``std`` (S) per Gram coordinate (sensitivity 1), ridge ``λ``,
    and every whitened row's norm (``row_norm``: the scale the preset's learning rate and clipping
    norm were tuned at)."""

    std: float
    ridge: float
    row_norm: float

    @property
    def event(self) -> Gaussian:
        return Gaussian(self.std)


def gram_of_rows(rows: np.ndarray, chunk: int = GRAM_CHUNK) -> np.ndarray:
    """``Σ z zᵀ`` over the rows (float64 accumulation of float32 chunk products), each row first scaled
    down to norm ≤ 1 if above it and a row holding a non-finite value taken as zeros (per-record rules:
    the release's sensitivity bound holds for every record, review revJ J1).

    Guarantee: every float32 row entering the product has norm ≤ 1 (measured in float64). The scaling
    is done in float64 and cast once (a float32 factor ``1/norm`` is subnormal for a row of norm
    ~1e40, and the scaled row overshot norm 1 by up to 5e-6: review revK K7); a row whose cast still
    lands above 1 (rounding of each coordinate, ≤ 2⁻²⁴ relative) is divided by its norm times
    ``1 + 2⁻²²``, which no rounding can undo."""
    import torch

    from veil.models.scattering import finite_rows_or_zero

    d = rows.shape[1]
    total = np.zeros((d, d), dtype=np.float64)
    part = torch.empty(d, d, dtype=torch.float32)  # one chunk's product, reused
    for i in range(0, len(rows), chunk):
        z = finite_rows_or_zero(torch.from_numpy(np.ascontiguousarray(rows[i : i + chunk], dtype=np.float32)))
        z = _within_unit_norm(z)
        torch.mm(z.T, z, out=part)
        np.add(total, part.numpy(), out=total)  # numpy casts chunk-wise: no d × d float64 temporary
    return total


def _within_unit_norm(z: torch.Tensor) -> torch.Tensor:
    """Float32 rows scaled down (in float64) to norm ≤ 1 where above it; see :func:`gram_of_rows`."""
    import torch

    wide = z.double()
    scaled = (wide / wide.norm(dim=1, keepdim=True).clamp_min(1.0)).float()
    after = scaled.double().norm(dim=1, keepdim=True)
    over = after > 1.0
    if bool(over.any()):
        shrunk = (scaled.double() / (after * (1.0 + 2.0**-22))).float()
        scaled = torch.where(over, shrunk, scaled)
    return scaled


def release_gram(rows: np.ndarray, std: float, rng: RandomSource) -> np.ndarray:
    """The released ``G̃`` (float32, symmetric): :func:`gram_of_rows` plus one ``N(0, std²)`` draw per
    upper-triangle coordinate, mirrored, rounded to the release grid (module docstring: the event is
    ``Gaussian(std)``). Call only after that event is charged."""
    import torch

    from veil.optimizer import release_grid

    gram = gram_of_rows(rows)
    d = len(gram)
    first = 0
    while first < d:  # rows first … last − 1 drawn in one call of ≤ NOISE_BLOCK values (or one row)
        last, count = first + 1, d - first
        while last < d and count + d - last <= NOISE_BLOCK:
            count, last = count + d - last, last + 1
        noise = rng.normal((count,), std, dtype=torch.float64).numpy()
        start = 0
        for i in range(first, last):  # row i's upper part gets its own draws; the column below mirrors it
            gram[i, i:] += noise[start : start + d - i]
            gram[i + 1 :, i] = gram[i, i + 1 :]
            start += d - i
        first = last
    grid = release_grid(std)  # in place: no d × d temporaries (a power of two: × and ÷ are exact)
    gram /= grid
    np.rint(gram, out=gram)
    gram *= grid
    return gram.astype(np.float32)


def whitener(gram: np.ndarray, n: int, ridge: float) -> np.ndarray:
    """``P = (max(G̃, 0)/n + λI)^(-1/2)`` (float32, symmetric) from a released Gram matrix
    (post-processing: eigenvalues the noise made negative are taken as 0, λ keeps the
    noise-dominated directions from being blown up). Float64 arithmetic, two ``d × d`` float64
    arrays at the peak (module docstring). A float64 Fortran-ordered ``gram`` is overwritten (pass
    :func:`eigh_ready` of the release and drop the release first); anything else is copied once."""
    from scipy.linalg import eigh

    vals, vecs = eigh(eigh_ready(gram), overwrite_a=True, check_finite=False, driver="evr")
    root = 1.0 / np.sqrt(np.maximum(vals, 0.0) / n + ridge)
    vecs *= np.sqrt(root)  # in place: V·diag(√root), so P = (V·diag(√root))(V·diag(√root))ᵀ, symmetric
    half = vecs.astype(np.float32)
    del vecs
    return half @ half.T


def eigh_ready(gram: np.ndarray) -> np.ndarray:
    """``gram`` as the float64 Fortran-ordered array LAPACK works in (itself if it already is one): a
    C-ordered array would be copied again by the wrapper, a third ``d × d`` float64 array."""
    return np.asarray(gram, dtype=np.float64, order="F")


def whiten_rows_(rows: np.ndarray, rule: nn.Module, chunk: int = 4096) -> None:
    """``rows ← rule(rows)`` in place, chunk by chunk (no second copy of the rows): the cached unit rows
    through :class:`~veil.models.scattering.WhitenedRows`, the very map the released model applies."""
    import torch

    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            part = torch.from_numpy(rows[i : i + chunk])
            part.copy_(rule(part))
