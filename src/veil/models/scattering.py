"""A fixed wavelet scattering front end (Mallat 2012; Bruna & Mallat 2013) for DP image models.

Tramèr & Boneh (2021, "Differentially private learning needs better features") showed that a
linear model on second-order scattering coefficients beats end-to-end CNNs under DP-SGD on small
image datasets: the features are good, and nothing in them is learned, so DP-SGD only has to train
a small head. The transform here is that map, written from its definition:

* Morlet wavelets ``ψ_{j,θ}`` at scales ``2^j`` (``j < J``) and ``L`` angles ``θ = πl/L``: a Gabor
  function (Gaussian envelope of width ``0.8·2^j``, elongated along the wave fronts with slant
  ``4/L``, carrier frequency ``3π/4 / 2^j``) minus a multiple of its envelope so it has zero mean;
* a Gaussian low-pass ``φ_J`` of width ``0.8·2^J``;
* order 0: ``x ⋆ φ_J``; order 1: ``|x ⋆ ψ_{j,θ}| ⋆ φ_J``; order 2 (``j₁ < j₂``):
  ``||x ⋆ ψ_{j₁,θ₁}| ⋆ ψ_{j₂,θ₂}| ⋆ φ_J``; each sampled every ``2^J`` pixels.

Convolutions are circular on the image padded by reflection (``2^J`` pixels a side), computed by
FFT; the low-pass and sub-sampling are done in the Fourier domain (periodisation). Each image gives
``C·K`` channels of ``⌈H/2^J⌉ × ⌈W/2^J⌉`` with ``K = 1 + J·L + L²·J(J−1)/2`` (81 for J = 2, L = 8).

Privacy: the map has no trainable parameters, uses no data to build its filters, and transforms
each example on its own (no batch statistics, no randomness). Neighbouring datasets (one example
added or removed) therefore stay neighbouring after the map, and any DP guarantee of training on
the features holds for the images: precomputing the features once costs no privacy.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

__all__ = [
    "MultiScaleScattering",
    "Scattering2d",
    "ScatteringHead",
    "UnitRows",
    "WhitenedRows",
    "finite_rows_or_zero",
    "scattering_channels",
    "scattering_features",
    "unit_rows_net",
]


def scattering_channels(J: int, L: int) -> int:
    """Output channels per input channel: ``1 + J·L + L²·J(J−1)/2``."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def _gabor(size: tuple[int, int], sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """A Gabor filter on a periodic ``size`` grid (origin at index 0), summed over nearby periods."""
    rows, cols = size
    c, s = math.cos(theta), math.sin(theta)
    rot = np.array([[c, -s], [s, c]])
    # Quadratic form of the envelope: narrow along θ (the wave), wide across it (the fronts).
    curvature = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2 * sigma * sigma)
    out = np.zeros(size, dtype=np.complex128)
    for dr in (-2, -1, 0, 1, 2):
        for dc in (-2, -1, 0, 1, 2):
            r, q = np.mgrid[dr * rows : (dr + 1) * rows, dc * cols : (dc + 1) * cols].astype(np.float64)
            quad = curvature[0, 0] * r * r + 2 * curvature[0, 1] * r * q + curvature[1, 1] * q * q
            out += np.exp(-quad + 1j * xi * (r * c + q * s))
    return out / (2 * math.pi * sigma * sigma / slant)


def _morlet(size: tuple[int, int], sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    wave = _gabor(size, sigma, theta, xi, slant)
    envelope = _gabor(size, sigma, theta, 0.0, slant)
    return wave - envelope * (wave.sum() / envelope.sum())


class Scattering2d(nn.Module):
    """Second-order 2D scattering transform: ``(N, C, H, W) → (N, C·K, ⌈H/2^J⌉, ⌈W/2^J⌉)``.

    Holds its filters as non-persistent buffers (rebuilt from ``J``, ``L`` and the image size, so
    they are not part of the state dict); no parameters. ``J ≥ 1`` is the number of scales (the
    output is sub-sampled by ``2^J``), ``L`` the number of angles.
    """

    psi: torch.Tensor

    def __init__(self, input_shape: tuple[int, int, int], J: int = 2, L: int = 8) -> None:
        super().__init__()
        if J < 1 or L < 1:
            raise ValueError(f"J and L must be ≥ 1, got J={J}, L={L}")
        channels, height, width = (int(v) for v in input_shape)
        self.J, self.L = int(J), int(L)
        self.input_shape = (channels, height, width)
        step = 2**J
        self._pads = []
        padded = []
        for n in (height, width):
            total = math.ceil((n + 2 * step) / step) * step
            self._pads.append((step, total - n - step))
            padded.append(total)
        self._padded = (padded[0], padded[1])
        self.out_hw = (math.ceil(height / step), math.ceil(width / step))
        slant = 4.0 / L
        psi = [
            _morlet(self._padded, 0.8 * 2**j, math.pi * k / L, 3 * math.pi / 4 / 2**j, slant)
            for j in range(J)
            for k in range(L)
        ]
        self.register_buffer("psi", torch.from_numpy(np.fft.fft2(np.stack(psi))).to(torch.complex64), False)
        # The isotropic Gaussian low-pass is separable, so "convolve with φ_J, keep every 2^J-th
        # pixel, crop the padding" is one small matrix per axis: out = Φ_h · u · Φ_wᵀ. One pair per
        # resolution 2^j at which a modulus is computed (order 2 runs at the resolution of j₂).
        for j in range(J):
            self.register_buffer(f"phi_h{j}", self._lowpass_matrix(self._padded[0], self.out_hw[0], j), False)
            self.register_buffer(f"phi_w{j}", self._lowpass_matrix(self._padded[1], self.out_hw[1], j), False)

    def _lowpass_matrix(self, padded: int, out: int, j: int) -> torch.Tensor:
        """Rows of ``φ_J`` at the grid sub-sampled by ``2^j``, centred on the kept output pixels."""
        sub = 2**j
        size, step, sigma = padded // sub, 2**self.J // sub, 0.8 * 2**self.J / sub
        offsets = np.arange(size, dtype=np.float64)
        g = sum(np.exp(-((offsets + k * size) ** 2) / (2 * sigma * sigma)) for k in range(-2, 3))
        g = g / g.sum()  # periodic Gaussian, g[d] = weight of a pixel d positions away (mod size)
        centres = step * np.arange(1, out + 1)  # sampled positions after dropping the padded border
        rows = g[(centres[:, None] - np.arange(size)[None, :]) % size]
        return torch.from_numpy(rows).to(torch.float32)

    @property
    def channels(self) -> int:
        return self.input_shape[0] * scattering_channels(self.J, self.L)

    def _lowpass(self, u: torch.Tensor, j: int = 0) -> torch.Tensor:
        """``(u ⋆ φ_J)`` sampled every ``2^J`` pixels, padding cropped; ``u`` real, at resolution ``2^j``."""
        rows: torch.Tensor = getattr(self, f"phi_h{j}")
        cols: torch.Tensor = getattr(self, f"phi_w{j}")
        return rows.to(u.dtype) @ u @ cols.to(u.dtype).T

    def _subsample(self, spectrum: torch.Tensor, j: int) -> torch.Tensor:
        """The spectrum of the signal kept every ``2^j`` pixels (periodisation of the spectrum)."""
        if j == 0:
            return spectrum
        k = 2**j
        for dim in (-2, -1):  # sum the k shifted copies along each axis (slices: cheap, contiguous adds)
            size = spectrum.shape[dim] // k
            spectrum = sum(
                (spectrum.narrow(dim, i * size, size) for i in range(1, k)), spectrum.narrow(dim, 0, size)
            )
        return spectrum / (k * k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        c, h, w = self.input_shape
        # float64 in, float64 throughout (the clipping check runs in float64); else float32.
        real = torch.float64 if x.dtype == torch.float64 else torch.float32
        psi = self.psi.to(torch.complex128 if real == torch.float64 else torch.complex64)
        work = x.reshape(n * c, 1, h, w).to(real)
        (top, bottom), (left, right) = self._pads
        work = nn.functional.pad(work, (left, right, top, bottom), mode="reflect")
        u1 = torch.fft.ifft2(torch.fft.fft2(work) * psi).abs()  # (n·c, J·L, ph, pw)
        parts = [self._lowpass(work), self._lowpass(u1)]
        L = self.L
        for j1 in range(self.J - 1):
            first = torch.fft.fft2(u1[:, j1 * L : (j1 + 1) * L]).unsqueeze(2)  # (n·c, L, 1, ph, pw)
            for j2 in range(j1 + 1, self.J):
                later = psi[j2 * L : (j2 + 1) * L]
                # |u1 ⋆ ψ_j2| varies on the scale 2^j2: computed on that coarser grid.
                u2 = torch.fft.ifft2(self._subsample(first * later, j2)).abs()  # (n·c, L, L, ·, ·)
                parts.append(self._lowpass(u2.flatten(1, 2), j2))
        out = torch.cat(parts, dim=1)
        return out.reshape(n, c * out.shape[1], *self.out_hw).to(x.dtype)

    def extra_repr(self) -> str:
        return f"J={self.J}, L={self.L}, input_shape={self.input_shape}"


class MultiScaleScattering(nn.Module):
    """The scattering transforms of one image at several numbers of scales ``J``, each flattened, then
    concatenated: ``(N, C, H, W) → (N, Σ_J C·K_J·⌈H/2^J⌉·⌈W/2^J⌉)``.

    ``J = 2`` alone keeps 7 × 7 positions of a 28 × 28 image; adding ``J = 1`` (9 channels of 14 × 14)
    gives a linear head the finer positions back (on Fashion-MNIST the non-private ceiling of the head
    rose from 0.907 to 0.915, docs/benchmarks.md). Privacy: as :class:`Scattering2d`, no parameters,
    no data used to build it, each example mapped on its own; a concatenation of such maps is one."""

    def __init__(
        self, input_shape: tuple[int, int, int], scales: tuple[int, ...] = (2, 1), L: int = 8
    ) -> None:
        super().__init__()
        self.transforms = nn.ModuleList(Scattering2d(input_shape, J=j, L=L) for j in scales)

    @property
    def parts(self) -> list[tuple[int, int, int]]:
        """``(channels, height, width)`` of each scale's maps, in the order of the output."""
        return [(t.channels, *t.out_hw) for t in self.scatterings]

    @property
    def scatterings(self) -> list[Scattering2d]:
        return [t for t in self.transforms if isinstance(t, Scattering2d)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x).flatten(1) for t in self.transforms], dim=1)


def _norm_groups(channels: int) -> int:
    """Groups of 3 channels where they divide (Tramèr & Boneh 2021: 27 groups for 81 channels), else 1."""
    return channels // 3 if channels % 3 == 0 else 1


class ScatteringHead(nn.Module):
    """The trainable head on :class:`MultiScaleScattering`'s rows: each scale's maps cut out of the row,
    group-normalised on their own (per example: no batch statistics), then one linear layer on all.

    Trained by DP-SGD through veil's per-layer rules (GroupNorm, Linear); slicing and concatenating
    rows mixes no examples."""

    def __init__(self, parts: list[tuple[int, int, int]], num_classes: int) -> None:
        super().__init__()
        self.parts = [tuple(int(v) for v in p) for p in parts]
        self.norms = nn.ModuleList(nn.GroupNorm(_norm_groups(c), c) for c, _, _ in self.parts)
        self.linear = nn.Linear(sum(c * h * w for c, h, w in self.parts), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for norm, (c, h, w) in zip(self.norms, self.parts, strict=True):
            size = c * h * w
            out.append(norm(x[:, start : start + size].reshape(-1, c, h, w)).flatten(1))
            start += size
        return self.linear(torch.cat(out, dim=1))


def finite_rows_or_zero(z: torch.Tensor) -> torch.Tensor:
    """``z`` with every row that holds a non-finite value replaced by zeros: a public per-record rule
    (each row decided from its own values), so one record's overflow can never spread through a
    statistic summed over the rows. (A row's norm can overflow to inf while its values are finite;
    the callers apply it again after scaling.)"""
    return torch.where(torch.isfinite(z).all(dim=1, keepdim=True), z, torch.zeros((), dtype=z.dtype))


class UnitRows(nn.Module):
    """The whitened preset's fixed per-record map of :class:`MultiScaleScattering`'s rows: each scale's
    maps group-normalised as :class:`ScatteringHead` does at its initial affine (i.e. none), flattened,
    concatenated, scaled to L2 norm ``√(1 − b²)``, then a constant coordinate ``b``.

    Guarantee: every output row has L2 norm ≤ 1 (exactly 1 up to float rounding), whatever the record
    — a public per-record rule, the sensitivity bound of the Gram release of
    :mod:`veil.data.whitening`. A record whose normalised maps are not finite (a finite float image
    can overflow the scattering front to ±inf, and group normalisation then gives NaN) gets the zero
    row before the constant coordinate: its output is ``(0, …, 0, b)``, finite and of norm ``b``,
    whatever its values (review revJ J1: one NaN row made the whole Gram release NaN and the released
    ``P`` exactly 0). No parameters, no batch statistics: each row from its own example."""

    def __init__(self, parts: list[tuple[int, ...]], constant: float = 0.3) -> None:
        super().__init__()
        if not 0.0 <= constant < 1.0:
            raise ValueError(f"the constant coordinate must lie in [0, 1), got {constant}")
        self.parts = [tuple(int(v) for v in p) for p in parts]
        self.constant = float(constant)

    @property
    def out_features(self) -> int:
        return sum(c * h * w for c, h, w in self.parts) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for c, h, w in self.parts:
            size = c * h * w
            part = x[:, start : start + size].reshape(-1, c, h, w)
            out.append(nn.functional.group_norm(part, _norm_groups(c)).flatten(1))
            start += size
        z = finite_rows_or_zero(torch.cat(out, dim=1))
        radius = math.sqrt(1.0 - self.constant * self.constant)
        z = finite_rows_or_zero(z * (radius / z.norm(dim=1, keepdim=True).clamp_min(1e-12)))
        return torch.cat([z, torch.full((len(z), 1), self.constant, dtype=z.dtype, device=z.device)], dim=1)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, constant={self.constant}"


class WhitenedRows(nn.Module):
    """The whitened preset's last fixed per-record map: ``z ↦ norm · zP / ‖zP‖`` with ``P`` the public
    whitening matrix (the buffer ``whitener``, ``d × d`` float32, set from the DP-released Gram matrix
    by :func:`veil.data.whitening.whitener`) and ``norm`` the preset's row norm (60).

    Each row is mapped on its own by public values (``P`` is post-processing of a DP release), so
    precomputing the map once costs no privacy. Before ``P`` is set the buffer is empty and the map is
    the identity: the unit rows the Gram matrix is released from. ``load_state_dict`` takes ``P`` at
    the size it was saved with, so a released ``model.pt`` (which carries ``P``: 4·d² bytes, 131.5 MB
    for Fashion-MNIST's d = 5,734) loads into a freshly built model."""

    whitener: torch.Tensor

    def __init__(self, norm: float) -> None:
        super().__init__()
        if not norm > 0:
            raise ValueError(f"the row norm must be positive, got {norm}")
        self.norm = float(norm)
        self.register_buffer("whitener", torch.empty(0))

    def set_whitener(self, p: torch.Tensor) -> None:
        """Install ``P`` (kept as given: a float32 tensor shares a numpy array's memory)."""
        if p.dim() != 2 or p.shape[0] != p.shape[1]:
            raise ValueError(f"the whitener must be a square matrix, got shape {tuple(p.shape)}")
        self.whitener = p

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.whitener.numel() == 0:
            return z
        w = finite_rows_or_zero(z @ self.whitener.to(z.dtype))
        return finite_rows_or_zero(w * (self.norm / w.norm(dim=1, keepdim=True).clamp_min(1e-12)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        key = prefix + "whitener"
        if key in state_dict:  # P at its saved size (empty before it is set)
            self.whitener = torch.empty_like(state_dict[key], device=self.whitener.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"norm={self.norm}, whitener={tuple(self.whitener.shape)}"


def unit_rows_net(net: nn.Module, constant: float = 0.3, row_norm: float = 60.0) -> nn.Module:
    """The two-scale scattering model with its head replaced for the whitened preset: the fixed front
    followed by :class:`UnitRows` and :class:`WhitenedRows` (still fixed, so precomputed once), then one
    linear layer on the whitened rows (initialised from torch's generator, as the caller seeded it)."""
    from veil.models import FixedFeaturesThenHead

    if not (isinstance(net, FixedFeaturesThenHead) and isinstance(net.head, ScatteringHead)):
        raise TypeError(f"unit rows need the two-scale scattering model, got {type(net).__name__}")
    rows = UnitRows(net.head.parts, constant)
    return FixedFeaturesThenHead(
        nn.Sequential(net.features, rows, WhitenedRows(row_norm)),
        nn.Linear(rows.out_features, net.head.linear.out_features),
    )


def scattering_features(x: np.ndarray, J: int = 2, L: int = 8, batch_size: int = 512) -> np.ndarray:
    """The scattering coefficients of float images ``x`` (``N×C×H×W``) as a float32 array."""
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim != 4:
        raise ValueError(f"expected images of shape N×C×H×W, got {arr.shape}")
    transform = Scattering2d(tuple(arr.shape[1:]), J=J, L=L)
    out = np.empty((len(arr), transform.channels, *transform.out_hw), dtype=np.float32)
    with torch.no_grad():
        for i in range(0, len(arr), batch_size):
            out[i : i + batch_size] = transform(torch.from_numpy(arr[i : i + batch_size])).numpy()
    return out
