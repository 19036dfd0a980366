"""Keystream words to float32 Gaussian noise, in torch ops on any device (the fast secure path).

:meth:`veil.mechanisms.rng.SecureSource.normal` makes noise for float32, bfloat16 and float16
parameters here: from 32-bit keystream words, whether they come from the ``cryptography`` package's
ChaCha20 on the host (:mod:`veil.mechanisms.keystream`) or from the same cipher in torch ops on an
accelerator (:mod:`veil.mechanisms.chacha_torch`). The float64 transform of
:mod:`veil.mechanisms.rng` stays the path for float64 parameters.

**The transform** (one pair of 32-bit words ``(a, b)`` per two coordinates, 4 bytes a coordinate):

* radius: ``u ∈ (0, 1)`` is the float32 just below an exact uniform. Its exponent is the number
  ``z`` of leading zero bits among the top 9 bits of ``a`` (when all 9 are zero, probability 2⁻⁹,
  9 more come from a fresh word, and so on: the exponential is memoryless, so a fresh word is
  exactly the conditional law); its mantissa is the low 23 bits of ``a``:
  ``u = 2⁻ᶻ·(1 + m·2⁻²³)/2``, built exactly from bits (the exponent field of the float32 ``top``
  value of the 9 bits is ``135 − z``). So ``u`` has full float32 relative precision at every scale
  and ``E = −ln u`` (one float32 ``log`` of the exact ``u``, accurate to a few ulps of ``E``) is an
  ``Exp(1)`` variate to float32 rounding far into the tail. The radius ``r = √(2E)`` is **not
  truncated** where a fixed-width uniform would stop it (6.66σ for 32 bits): the continuation
  reaches 37σ before a safety cap of 1008 exponent bits, the float64 path's cap, hit with
  probability 2⁻¹⁰⁰⁸.
* angle: ``θ = 2π·j·2⁻²⁴`` with ``j`` the top 24 bits of ``b``; the pair gives ``r·cos θ`` and
  ``r·sin θ``, two independent ``N(0, 1)``, times ``std``.

**Why float32 keeps the guarantee of the float64 transform** (for noise that ends in float32 or
coarser). What DP-SGD releases is the noisy gradient rounded to the power-of-two grid of
:func:`veil.optimizer.release_grid` (step ``g > σ/512``), so two properties matter:
(i) *reachability* — every grid cell is reachable from either neighbouring input, which needs the
transform's output values to be far denser than ``g``: consecutive radii here are at most
``2⁻²³·r`` apart beyond ``r = 1`` and the smallest non-zero radius is ``3.5e-4`` (both ≪ 1/512),
and the angle steps ``2π·2⁻²⁴·r ≤ 1.4e-5`` at ``r ≤ 37``; (ii) *the law of a cell* — each cell's
probability must be the Gaussian's up to an error below what is already accepted. The float64
sampler's output is rounded to float32 before it is added (a shift of each value by up to half an
ulp32), and the addition of the clipped sum rounds again; here ``log``, ``sqrt``, ``cos``, ``sin``
and the products each add at most a few float32 ulps (torch's vectorised float32 functions are
accurate to ≤ 1–4 ulp), the same order as those roundings, and the 2²⁴-point angle grid integrates a
smooth periodic function, whose error is negligible. So a cell's probability moves by a relative
``O(ulp32(z)/g) ≈ 6e-5·|z|/σ``: the order the float64 sampler's final cast already had, and below
what the statistical tests (which do reject a std off by 2 %) can see. Float64 parameters keep the
float64 transform (its ulp is 2²⁹ times finer, and so is the release's).

The tail argument of :mod:`veil.mechanisms.rng` (a truncated sampler certifies an input whenever its
output lands beyond the truncation point) is unchanged: the radius is unbounded up to 37σ here too.

One transform, two array libraries: on the host it runs in numpy (single-threaded SIMD ``log``,
``cos``, ``sin``: no thread-pool barriers, which on a shared or loaded machine cost more than the
arithmetic, and it releases the GIL, so a worker thread can draw while the step runs), on an
accelerator in torch; :class:`_NumpyOps` and :class:`_TorchOps` are the only difference (the host
spells the same steps in place, in fewer passes: :func:`_host_normal_from_words`). This module
imports numpy only; torch is imported when words arrive as tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["CHUNK", "angle_from_words32", "exponential_from_words32", "normal_from_words"]

#: Coordinates transformed at a time on the host: the temporaries (about 4 MiB) stay in cache, where
#: chunks of 2²⁰ spilled (a loaded 2-core machine, interleaved: 2²⁰ ≈ 80 ms, 2¹⁶–2¹⁸ ≈ 44 ms for 2²² draws).
CHUNK = 1 << 18
_LN2 = math.log(2.0)
_EXP_BITS = 9  # leading bits of a radius word that set the exponent of u
_MANTISSA_MASK = (1 << 23) - 1
_EXPONENT_FIELD = 0x7F800000  # a float32's exponent bits
_EXP_SHIFT = _EXP_BITS << 23  # exponent field of float32(top) minus this: the exponent of 2⁻ᶻ/2
_ONE_BITS = 0x3F800000  # float32 1.0 (ln 1 = 0): stands in for a word continued by fresh words
_ANGLE_STEP = 2.0 * math.pi * 2.0**-24
_MAX_EXTRA_WORDS = 111  # 9 + 111·9 = 1008 exponent bits: then u = 1 (E = 999·ln 2), r ≤ 37.21

#: ``k ↦ k`` fresh int32 keystream words: a numpy array (host) or a tensor (any torch device).
Words = Callable[[int], Any]


class _NumpyOps:
    """The few operations where numpy and torch spell things differently: numpy's spelling."""

    @staticmethod
    def float32(x: Any) -> Any:
        return x.astype(np.float32)

    @staticmethod
    def bits_as_float32(x: Any) -> Any:
        return x.view(np.float32)

    @staticmethod
    def float32_bits(x: Any) -> Any:
        return x.view(np.int32)

    @staticmethod
    def at_most(x: Any, bound: int) -> Any:
        return np.minimum(x, bound)

    @staticmethod
    def indices(mask: Any) -> Any:
        return np.flatnonzero(mask)

    log, sqrt, cos, sin, multiply = np.log, np.sqrt, np.cos, np.sin, np.multiply


class _TorchOps:
    """torch's spelling of :class:`_NumpyOps` (any device)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.log, self.sqrt, self.cos, self.sin = torch.log, torch.sqrt, torch.cos, torch.sin
        self.multiply = torch.mul

    @staticmethod
    def float32(x: Any) -> Any:
        return x.float()

    def bits_as_float32(self, x: Any) -> Any:
        return x.view(self.torch.float32)

    def float32_bits(self, x: Any) -> Any:
        return x.view(self.torch.int32)

    @staticmethod
    def at_most(x: Any, bound: int) -> Any:
        return x.clamp(max=bound)

    @staticmethod
    def indices(mask: Any) -> Any:
        return mask.nonzero().squeeze(1)


def _ops(words: Any) -> Any:
    return _NumpyOps if isinstance(words, np.ndarray) else _TorchOps()


def exponential_from_words32(words: Any, more: Words) -> Any:
    """``E = −ln u`` (float32, ``Exp(1)``) per int32 word; ``more(k)``: ``k`` fresh words (same kind).

    See the module docstring for ``u``; words whose top 9 bits are zero continue with fresh words.
    """
    ops = _ops(words)
    e, zero_top = _exponential_parts(ops, words)
    pending = ops.indices(zero_top)
    if len(pending):
        e[pending] = _continued(ops, len(pending), more)
    return e


def _continued(ops: Any, count: int, more: Words) -> Any:
    """``E`` for ``count`` words whose top 9 bits were all zero: fresh words from ``more`` continue
    each one's exponent (``9·depth·ln 2`` plus the first fresh word's own ``−ln u``)."""
    e: Any = None
    pending: Any = None
    depth = 0
    while depth < _MAX_EXTRA_WORDS:
        depth += 1
        e_extra, again = _exponential_parts(ops, more(count if pending is None else len(pending)))
        e_extra += _EXP_BITS * depth * _LN2
        if pending is None:
            e = e_extra
            pending = ops.indices(again)
        else:
            e[pending] = e_extra
            pending = pending[again]
        if not len(pending):
            break
    return e


def _exponential_parts(ops: Any, words: Any) -> tuple[Any, Any]:
    """``(−ln u, whether the word's top 9 bits were all zero)`` for each int32 word on its own."""
    top = (words >> (32 - _EXP_BITS)) & ((1 << _EXP_BITS) - 1)  # 0 … 511 (masked: >> is arithmetic)
    zero_top = top == 0
    # float32(top) = 2^(8−z)·(1.f): its exponent field, less 9, is that of 2⁻ᶻ·½; the word's low 23
    # bits are u's mantissa. A zero top (continued by fresh words) gets u = 1 here: ln 1 = 0.
    u = (ops.float32_bits(ops.float32(top)) & _EXPONENT_FIELD) - _EXP_SHIFT
    u |= words & _MANTISSA_MASK
    u[zero_top] = _ONE_BITS
    e = ops.log(ops.bits_as_float32(u))
    e *= -1.0
    return e, zero_top


def angle_from_words32(words: Any) -> Any:
    """``θ = 2π·j·2⁻²⁴`` (float32) with ``j`` the top 24 bits of each int32 word."""
    ops = _ops(words)
    theta = ops.float32((words >> 8) & 0xFFFFFF)
    theta *= _ANGLE_STEP
    return theta


def normal_from_words(
    out: Any, words: Words, std: float, then: Callable[[int, int], None] | None = None
) -> None:
    """Fill the 1-d float32 array or tensor ``out`` with i.i.d. ``N(0, std²)`` noise from ``words``.

    ``words(k)`` returns ``k`` fresh int32 keystream words of ``out``'s kind (numpy for a numpy
    ``out``, a tensor on ``out``'s device for a tensor). ``out`` is filled in chunks of :data:`CHUNK`
    coordinates on the host (bounded temporaries) and at once on an accelerator; within a chunk of
    ``k`` the first ``⌈k/2⌉`` values are the pairs' cosines and the rest their sines. A numpy ``out``
    takes :func:`_host_normal_from_words`, the same arithmetic with fewer passes over memory (equal
    bit for bit: a test compares the two). ``then(lo, hi)``, if given, is called once ``out[lo:hi]``
    holds its noise: after each chunk on the host (the chunk still in the cache), once at the end
    on an accelerator.
    """
    if isinstance(out, np.ndarray):
        _host_normal_from_words(out, words, std, then)
        return
    _normal_from_words(out, words, std, _TorchOps())
    if then is not None:
        then(0, len(out))


def _normal_from_words(out: Any, words: Words, std: float, ops: Any) -> None:
    """The transform of :func:`normal_from_words` in ``ops``' spelling (numpy or torch)."""
    n = len(out)
    on_host = isinstance(out, np.ndarray) or out.device.type == "cpu"
    chunk = CHUNK if on_host else max(n, 1)
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        m = (k + 1) // 2
        w = words(2 * m)
        r = exponential_from_words32(w[:m], words)
        r *= 2.0
        r = ops.sqrt(r)
        r *= std
        theta = angle_from_words32(w[m:])
        seg = out[start : start + k]
        ops.multiply(ops.cos(theta), r, out=seg[:m])
        seg[m:] = (ops.sin(theta) * r)[: k - m]


def _host_normal_from_words(
    out: np.ndarray, words: Words, std: float, then: Callable[[int, int], None] | None = None
) -> None:
    """:func:`_normal_from_words` in numpy with fewer passes and temporaries: the same float32
    operations on the same values, in place where the generic spelling makes temporaries (the secure
    noise draw is the DP step's largest fixed cost for a model with many parameters, and on a small
    model the memory it first touches is what it costs: inside a DP step, with the step's data in
    the cache, a draw that wrote 1.15 MB of fresh memory for 92,162 coordinates took twice its
    isolated time).

    Bit for bit the same because every change is exact: the chunk's keystream words are written
    into the chunk's own output memory (an even-sized chunk of a contiguous ``out``; an odd one, the
    last, uses a buffer of its own), read as unsigned, so a shift alone gives the top bits (no
    mask), and then reused in place (the mantissa bits of ``u``; the radius words' memory holds the
    angle once ``u`` is built; the float32 ``top`` is converted in its own memory); a word whose top
    9 bits are zero is recomputed whole by the continuation of :func:`exponential_from_words32`
    (fresh words, drawn after the chunk's, as there); ``−2·ln u`` is ``2·(−ln u)`` (both exact);
    the angle's cast and scaling are one float32 ufunc; ``cos``, ``sin`` and the products write into
    ``out``. One temporary of ``⌈k/2⌉`` words a chunk remains (``top``, then ``u``).

    ``then(lo, hi)``: called after each finished chunk ``out[lo:hi]`` (while it is in the cache).
    """
    n = len(out)
    f32 = np.float32
    contiguous = out.flags.c_contiguous
    for start in range(0, n, CHUNK):
        k = min(CHUNK, n - start)
        m = (k + 1) // 2
        seg = out[start : start + k]
        in_place = contiguous and k == 2 * m
        w = seg.view(np.uint32) if in_place else np.empty(2 * m, dtype=np.uint32)
        _words_into(words, w.view(np.int32))
        radius_words, angle_words = w[:m], w[m:]
        top = radius_words >> (32 - _EXP_BITS)  # 0 … 511: the chunk's one temporary
        pending = np.flatnonzero(top == 0)
        u = top.view(f32)
        # float32(top) = 2^(8−z)·(1.f), in its own memory; read as int32 (top < 2⁹: the same values),
        # whose conversion to float32 is one SIMD instruction where uint32's is not
        np.copyto(u, top.view(np.int32), casting="unsafe")
        bits = u.view(np.int32)
        bits &= _EXPONENT_FIELD
        bits -= _EXP_SHIFT  # the exponent of 2⁻ᶻ·½
        radius_words &= _MANTISSA_MASK  # a word with a zero top is left as it was
        bits |= radius_words.view(np.int32)  # u = 2⁻ᶻ·(1 + m·2⁻²³)/2
        if len(pending):  # 2⁻⁹ a word: recomputed whole by the generic continuation (fresh words)
            bits[pending] = _ONE_BITS
        np.log(u, out=u)
        u *= -2.0  # 2E = −2 ln u
        if len(pending):
            u[pending] = _continued(_NumpyOps, len(pending), words) * 2.0
        np.sqrt(u, out=u)
        u *= std
        angle_words >>= 8  # j: the top 24 bits
        theta = radius_words.view(f32)  # the radius words are consumed: their memory holds the angle
        # j < 2²⁴ read as int32 (the same values; the faster conversion, as for top above)
        np.multiply(angle_words.view(np.int32), _ANGLE_STEP, out=theta, dtype=f32, casting="unsafe")
        if in_place:  # theta is seg[:m]: the sines first, into the angle words' memory (consumed)
            np.sin(theta, out=seg[m:])
            seg[m:] *= u
            np.cos(theta, out=theta)
            theta *= u
        else:
            np.cos(theta, out=seg[:m])
            seg[:m] *= u
            np.sin(theta, out=theta)
            np.multiply(theta[: k - m], u[: k - m], out=seg[m:])
        if then is not None:
            then(start, start + k)


def _words_into(words: Words, buf: np.ndarray) -> None:
    """Write the next ``len(buf)`` int32 words of ``words`` into ``buf``: in place where the source
    can (``words.into``, the secure source's keystream), else copied from ``words(len(buf))``; the
    same words in the same order either way."""
    into = getattr(words, "into", None)
    if into is not None:
        into(buf)
    else:
        buf[...] = words(len(buf))
