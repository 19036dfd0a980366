"""The secure sampler veil used before the ChaCha20 keystream, kept only as a benchmark baseline.

``UrandomSource`` reads every byte from ``os.urandom`` and makes each Gaussian coordinate from two
float64 Box–Muller draws of ``std/√2`` (16 OS bytes per coordinate), as ``SecureSource`` did until
the keystream change. ``bench/engine.py --modes veil-urandom`` runs the default engine with it, so
the old and new secure noise are timed side by side in one interleaved run. Not for training.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from veil.mechanisms.rng import SecureSource

_INV_TWO_POW_53 = 1.0 / (1 << 53)


class UrandomSource(SecureSource):
    """The previous ``SecureSource``: OS bytes per draw, sum of two float64 Box–Muller draws."""

    _CHUNK = 1 << 20

    def _raw_uint64(self, n: int) -> np.ndarray:
        return np.frombuffer(os.urandom(8 * n), dtype="<u8").astype(np.uint64)

    def random_bits(self, k: int) -> int:
        if k <= 0:
            return 0
        nbytes = (k + 7) // 8
        return int.from_bytes(os.urandom(nbytes), "little") >> (8 * nbytes - k)

    def _open_uniform_pair(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        raw = self._raw_uint64(2 * n) >> np.uint64(11)
        u1 = (raw[:n] + np.uint64(1)).astype(np.float64) * _INV_TWO_POW_53
        return u1, raw[n:].astype(np.float64) * _INV_TWO_POW_53

    def normal(
        self, shape: tuple[int, ...], std: float, *, dtype: Any = None, device: Any = "cpu"
    ) -> torch.Tensor:
        out_dtype = torch.float32 if dtype is None else dtype
        n = math.prod(shape)
        dev = torch.device(device)
        out = torch.empty(n, dtype=out_dtype, device=dev)
        scale = std / math.sqrt(2.0)
        for start in range(0, n, self._CHUNK):
            k = min(self._CHUNK, n - start)
            m = (k + 1) // 2
            u1, u2 = self._open_uniform_pair(2 * m)
            r = torch.sqrt(-2.0 * torch.log(torch.from_numpy(u1).to(dev)))
            theta = (2.0 * math.pi) * torch.from_numpy(u2).to(dev)
            a = torch.cat([r[:m] * torch.cos(theta[:m]), r[:m] * torch.sin(theta[:m])])[:k]
            b = torch.cat([r[m:] * torch.cos(theta[m:]), r[m:] * torch.sin(theta[m:])])[:k]
            out[start : start + k] = ((a + b) * scale).to(out_dtype)
        return out.reshape(shape)


# -- the DP release of before the fourth issue-27 session, for interleaved before/after timing ----------
_F32_EXP_BITS = 9


def previous_host_normal_from_words(out: np.ndarray, words: Any, std: float, then: Any = None) -> None:
    """The host float32 transform of main 0cf85ea (radius ``E = z·ln 2 − ln h`` from separate arrays,
    chunks of 2¹⁸), kept to time before and after in one run; ``then`` is ignored (that code had none)."""
    from veil.mechanisms.box_muller import exponential_from_words32

    f32 = np.float32
    n = len(out)
    for start in range(0, n, 1 << 18):
        k = min(1 << 18, n - start)
        m = (k + 1) // 2
        w = words(2 * m)
        radius_words, angle_words = w[:m], w[m:].view(np.uint32)
        top = radius_words.view(np.uint32) >> (32 - _F32_EXP_BITS)
        zeros = top.astype(f32).view(np.int32)
        zeros >>= 23
        np.subtract(_F32_EXP_BITS - 1 + 127, zeros, out=zeros)
        half = radius_words & ((1 << 23) - 1)
        half |= 0x3F000000
        r = np.log(half.view(f32))
        scaled = zeros.astype(f32)
        scaled *= math.log(2.0)
        np.subtract(scaled, r, out=r)
        pending = np.flatnonzero(top == 0)
        if len(pending):
            r[pending] = exponential_from_words32(radius_words[pending], words)
        r *= 2.0
        np.sqrt(r, out=r)
        r *= std
        theta = (angle_words >> 8).astype(f32)
        theta *= 2.0 * math.pi * 2.0**-24
        seg = out[start : start + k]
        np.cos(theta, out=seg[:m])
        seg[:m] *= r
        np.sin(theta, out=theta)
        np.multiply(theta[: k - m], r[: k - m], out=seg[m:])


@contextlib.contextmanager
def release_of_before() -> Iterator[None]:
    """Inside: secure noise and the DP release as on main 0cf85ea (the host transform above, the clipped
    sum added and the grid applied by torch ops after the draw instead of inside it)."""
    import veil.mechanisms.box_muller as bm
    from veil.noise_ahead import NoiseAhead

    transform, finishes = bm._host_normal_from_words, NoiseAhead.finishes_in_draw
    bm._host_normal_from_words = previous_host_normal_from_words  # type: ignore[assignment]
    NoiseAhead.finishes_in_draw = lambda self, key: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        bm._host_normal_from_words, NoiseAhead.finishes_in_draw = transform, finishes  # type: ignore[method-assign]
