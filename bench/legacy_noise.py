"""The secure sampler veil used before the ChaCha20 keystream, kept only as a benchmark baseline.

``UrandomSource`` reads every byte from ``os.urandom`` and makes each Gaussian coordinate from two
float64 Box–Muller draws of ``std/√2`` (16 OS bytes per coordinate), as ``SecureSource`` did until
the keystream change. ``bench/engine.py --modes veil-urandom`` runs the default engine with it, so
the old and new secure noise are timed side by side in one interleaved run. Not for training.
"""

from __future__ import annotations

import math
import os
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
