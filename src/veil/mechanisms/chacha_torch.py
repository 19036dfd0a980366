"""ChaCha20 (RFC 8439) in torch integer ops: secure keystream made on the device that needs the noise.

For a model on an accelerator, :meth:`veil.mechanisms.rng.SecureSource.normal` draws its noise
here instead of on the host: the ChaCha20 block function runs as int32 tensor ops (additions wrap
modulo 2³², which is what the cipher's additions are; right shifts are masked, since torch's ``>>``
on int32 is arithmetic), vectorised over blocks, on any torch device. The result is the RFC 8439
keystream bit for bit (the RFC's test vectors are checked on the CPU in the test suite, and by
``bench/secure_noise_gpu.py`` on the device before it times anything).

Keys: :class:`DeviceKeystream` takes a fresh 256-bit key and 96-bit nonce from ``os.urandom`` on
the host when it is built, and the secure source builds one per Gaussian release, so one key never
covers two releases, a forked child never shares a parent's key (it builds its own on its next
release), and nothing of it is kept after the release (no attribute outlives the object, pickling
is refused). Block counters run from 0 and a stream refuses to pass 2³² blocks (256 GiB), so no
(key, nonce, counter) block is produced twice. Assumption: ChaCha20 under a uniform key is a
pseudorandom function (the same computational assumption as the host keystream).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import torch
from torch import Tensor

__all__ = ["DeviceKeystream", "block_function", "chacha20_blocks", "initial_state"]

_SIGMA = struct.unpack("<4I", b"expand 32-byte k")  # RFC 8439 §2.3 constants
_MAX_BLOCKS = 1 << 32


def _signed(words: tuple[int, ...]) -> list[int]:
    """Unsigned 32-bit words as the int32 values with the same bits."""
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def _rotl(x: Tensor, n: int) -> Tensor:
    """Rotate every int32 left by ``n`` bits (logical right shift by masking the arithmetic one)."""
    return (x << n) | ((x >> (32 - n)) & ((1 << n) - 1))


def _quarter_rounds(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RFC 8439 §2.1 quarter round on four rows of words at once (each ``[4, blocks]``)."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


def chacha20_blocks(key: bytes, nonce: bytes, counter: int, blocks: int, device: Any = "cpu") -> Tensor:
    """Keystream blocks ``counter … counter + blocks − 1`` as int32 words ``[blocks, 16]`` (little endian).

    ``key``: 32 bytes; ``nonce``: 12 bytes; the block counter is the 32-bit word 12 of the state
    (RFC 8439 §2.3).
    """
    return block_function(initial_state(key, nonce, counter, blocks, device))


def initial_state(key: bytes, nonce: bytes, counter: int, blocks: int, device: Any = "cpu") -> Tensor:
    """The ChaCha20 input states ``[16, blocks]`` (int32) of consecutive block counters."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("ChaCha20 takes a 32-byte key and a 12-byte nonce")
    if counter < 0 or counter + blocks > _MAX_BLOCKS:
        raise ValueError("the 32-bit block counter would wrap: a block would repeat")
    dev = torch.device(device)
    fixed = torch.tensor(
        [*_signed(_SIGMA + struct.unpack("<8I", key)), 0, *_signed(struct.unpack("<3I", nonce))],
        dtype=torch.int32,
        device=dev,
    )
    state = fixed.unsqueeze(1).expand(16, blocks).clone()
    counters = torch.arange(counter, counter + blocks, dtype=torch.int64, device=dev)
    state[12] = torch.where(counters >= 1 << 31, counters - (1 << 32), counters).to(torch.int32)
    return state


def block_function(state: Tensor) -> Tensor:
    """RFC 8439 §2.3 block function of every column of ``state`` ``[16, blocks]`` → ``[blocks, 16]``.

    Tensor in, tensor out (no key as a Python value), so ``torch.compile`` can fuse it into one
    kernel without recompiling per key. The column rounds act on the state's four rows at once, the
    diagonal rounds on the rows rotated by 1, 2, 3 (RFC 8439 §2.2 rewritten as row rotations).
    """
    a, b, c, d = state[0:4], state[4:8], state[8:12], state[12:16]
    for _ in range(10):  # 20 rounds: 10 × (column round, diagonal round)
        a, b, c, d = _quarter_rounds(a, b, c, d)
        a, b, c, d = _quarter_rounds(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return (torch.cat((a, b, c, d)) + state).T.contiguous()


class DeviceKeystream:
    """One key's ChaCha20 keystream on ``device``, served as int32 words; built once per release."""

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self._key = os.urandom(32)
        self._nonce = os.urandom(12)
        self._counter = 0
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"DeviceKeystream({self.device})"

    def __reduce__(self) -> Any:
        raise TypeError("a device keystream holds a key and is never pickled or copied")

    def words(self, n: int) -> Tensor:
        """The next ``n`` keystream words (int32, on the device); the counter only moves forward."""
        if self._pid != os.getpid():  # built before a fork: the child must not reuse the key
            raise RuntimeError("a device keystream was carried across a fork; build a new one")
        blocks = (n + 15) // 16
        out = chacha20_blocks(self._key, self._nonce, self._counter, blocks, self.device)
        self._counter += blocks
        return out.view(-1)[:n]
