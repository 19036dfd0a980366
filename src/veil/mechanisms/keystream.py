"""A fast cryptographic byte stream: ChaCha20 keystream keyed from the OS CSPRNG.

:class:`ChaChaKeystream` is where :class:`~veil.mechanisms.rng.SecureSource` gets its bytes. It
encrypts zeros with ChaCha20 (RFC 8439, from the ``cryptography`` package), so what it returns is
the keystream itself, at several GB/s instead of the few hundred MB/s of an ``os.urandom`` call
per draw.

Security argument (what the stream promises and what it assumes):

* **Keys.** Every key is 32 fresh bytes of ``os.urandom`` and exists only inside the cipher
  context (no attribute holds it, :meth:`~object.__reduce__` drops it, nothing writes it).
  A stream is re-keyed from the OS (a) before its first byte, (b) whenever its caller asks
  (:meth:`rekey`; the secure source does so once per Gaussian release, so one key never covers two
  releases), (c) after :data:`REKEY_BYTES` under one key, and (d) in a forked child before its
  first byte (an ``os.register_at_fork`` hook, with a pid check as a backstop): a child never
  continues its parent's keystream, so the two never draw the same bytes.
* **Nonce and counter.** The 16-byte ChaCha20 initial value is a 32-bit block counter (little
  endian, starting at 0) followed by a 96-bit nonce drawn from the OS. One cipher context per key
  advances the counter monotonically; :data:`REKEY_BYTES` (2²⁰ blocks) is far below the 2³²
  blocks the counter can address, so no (key, nonce, counter) block is ever produced twice.
* **Assumption.** ChaCha20 under a uniformly random 256-bit key is a pseudorandom function: no
  computationally bounded adversary can tell its keystream from uniform bytes. A guarantee built
  on these bytes is therefore *computational* (it holds against adversaries that cannot break
  ChaCha20), as it is for every CSPRNG-based DP library, and as it already was with
  ``os.urandom``, which on Linux is itself a ChaCha20-based generator seeded from the kernel's
  entropy pool. What changes is where the key lives: in this process's memory, for at most one
  release or :data:`REKEY_BYTES`. Someone who can read the process's memory during training can
  predict the rest of that release's noise, but then they can read the gradients directly.

Small reads (``random_bits`` of the exact discrete samplers) are served from a block of at most
4 KiB of keystream, dropped with the key (re-key, fork, pickle): it never outlives its key.

Thread safety: a lock serialises every read (a cipher context is not safe to share). The module
imports ``cryptography`` only when a stream is built, so ``import veil`` stays light.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["REKEY_BYTES", "ChaChaKeystream"]

KEY_BYTES = 32
NONCE_BYTES = 12
#: Bytes produced under one key before a fresh key is drawn from the OS: 2²⁰ ChaCha20 blocks, far
#: below the 2³² a 32-bit block counter can address without repeating.
REKEY_BYTES = 1 << 26
_SLICE = 1 << 16  # bytes per cipher call (the zero plaintext is this long, not the whole request)
_ZEROS = memoryview(bytes(_SLICE))
_BUFFER = 4096  # bytes of keystream kept for small reads

_LIVE: weakref.WeakSet[ChaChaKeystream] = weakref.WeakSet()


def _forget_keys_in_child() -> None:
    """After ``fork``, in the child: drop every inherited key (and any lock held by a parent thread)."""
    for stream in list(_LIVE):
        stream._forget()


if hasattr(os, "register_at_fork"):  # POSIX; where there is no fork there is nothing to forget
    os.register_at_fork(after_in_child=_forget_keys_in_child)


class ChaChaKeystream:
    """A ChaCha20 keystream keyed from ``os.urandom``; re-keyed on request, per volume and per fork.

    ``rekeys`` counts the keys drawn so far (tests check it; it is no secret). Pickling or copying
    gives a new, unkeyed stream: key material never leaves the process.
    """

    def __init__(self) -> None:
        # Imported here, when a secure source is built (a secure engine, a secure run), not with
        # veil: a missing package fails before anything is trained or charged, and the ~6 MiB the
        # package takes are not first touched in the middle of a training step.
        import cryptography.hazmat.primitives.ciphers  # noqa: F401

        self._lock = threading.Lock()
        self._cipher: Any = None
        self._used = 0
        self._pid = os.getpid()
        self._buf = bytearray()  # keystream for small reads (a cipher call costs microseconds)
        self._pos = 0
        self.rekeys = 0
        _LIVE.add(self)

    def __repr__(self) -> str:
        return "ChaChaKeystream()"

    def __reduce__(self) -> tuple[type[ChaChaKeystream], tuple[()]]:
        return (ChaChaKeystream, ())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._cipher = None
        self._used = 0
        self._pid = os.getpid()
        self._buf, self._pos = bytearray(), 0

    def _rekey_locked(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        initial = bytes(4) + os.urandom(NONCE_BYTES)  # block counter 0 (little endian), 96-bit nonce
        self._cipher = Cipher(algorithms.ChaCha20(os.urandom(KEY_BYTES), initial), mode=None).encryptor()
        self._used = 0
        self._pid = os.getpid()
        self._buf, self._pos = bytearray(), 0  # nothing made under the old key is served after this
        self.rekeys += 1

    def rekey(self) -> None:
        """Draw a fresh key (and nonce) from the OS now; later bytes are independent of earlier ones."""
        with self._lock:
            self._rekey_locked()

    def _fill_locked(self, view: memoryview) -> None:
        if self._cipher is None or self._pid != os.getpid():
            self._rekey_locked()
        n, pos = view.nbytes, 0
        while pos < n:
            k = min(_SLICE, n - pos)
            if self._used + k > REKEY_BYTES:
                self._rekey_locked()
            self._cipher.update_into(_ZEROS[:k], view[pos : pos + k])
            self._used += k
            pos += k

    def fill(self, out: Any) -> None:
        """Overwrite the writable, C-contiguous buffer ``out`` (e.g. a numpy array) with keystream bytes."""
        view = memoryview(out).cast("B")
        with self._lock:
            self._fill_locked(view)

    def read(self, n: int) -> bytes:
        """``n`` keystream bytes; small reads are served from a 4 KiB block of keystream."""
        if n >= _BUFFER:
            buf = bytearray(n)
            self.fill(buf)
            return bytes(buf)
        with self._lock:
            if self._pid != os.getpid():
                self._rekey_locked()  # a fork that skipped the hook: drop the inherited block too
            if self._pos + n > len(self._buf):
                block = bytearray(_BUFFER)
                self._fill_locked(memoryview(block))  # may re-key, which empties self._buf
                self._buf, self._pos = block, 0
            out = bytes(self._buf[self._pos : self._pos + n])
            self._pos += n
            return out
