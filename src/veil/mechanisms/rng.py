"""Randomness sources: seeded (reproducible research runs) and secure (the OS CSPRNG).

Every random draw in veil goes through a :class:`RandomSource`, so the choice between the two is
made once, in one place:

* :class:`SeededSource` — a numpy ``Generator(PCG64(seed))`` for numpy draws and a
  ``torch.Generator`` seeded from the same seed for tensor draws. The whole stream is restored by
  :meth:`SeededSource.load_state_dict`, so a resumed run draws exactly what an uninterrupted one
  would have. **Not** suitable for a deployed model: whoever knows (or guesses) the seed can
  recompute the noise and subtract it.
* :class:`SecureSource` — bytes from a ChaCha20 keystream keyed with fresh ``os.urandom`` keys
  (:mod:`veil.mechanisms.keystream`), never from a seeded PRNG. Its stream cannot be replayed, so
  its ``state_dict()`` is just ``{"secure": True}``. Tensors of Gaussian noise are made from those
  bytes by a float64 Box–Muller transform whose radius has full precision and no truncation in
  the tail (:meth:`SecureSource.normal` gives the argument); DP-SGD rounds the noisy gradient to
  a power-of-two grid, which is what blunts the floating-point attacks of Mironov (2012) and Jin
  et al. (2022) there; the scalar/array mechanisms of :mod:`veil.mechanisms` sample on an integer
  lattice in secure mode (see ``docs/mechanisms.md``).

Nothing here touches numpy's or torch's global generators. ``import veil.mechanisms`` does not
import torch (the tensor methods import it when first called).
"""

from __future__ import annotations

import abc
import itertools
import math
import os
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.errors import InvalidParameterError
from veil.mechanisms.keystream import ChaChaKeystream

if TYPE_CHECKING:
    import torch

__all__ = ["RandomSource", "SecureSource", "SeededSource", "make_source"]

_TWO_POW_53 = 1 << 53
_INV_TWO_POW_53 = 1.0 / _TWO_POW_53
_MAX_SEED = (1 << 64) - 1


def _check_size(size: int | tuple[int, ...]) -> tuple[int, ...]:
    shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise InvalidParameterError("size", size, "a sample shape is a tuple of counts", "pass ints ≥ 0")
    return tuple(int(s) for s in shape)


def _check_std(std: float) -> float:
    if isinstance(std, bool) or not isinstance(std, (int, float, np.floating, np.integer)):
        raise InvalidParameterError("std", std, "the noise scale must be a real number", "pass σ ≥ 0")
    if not math.isfinite(std) or std < 0:
        raise InvalidParameterError(
            "std", std, "the noise scale sets the privacy guarantee and must be finite and ≥ 0", "pass σ ≥ 0"
        )
    return float(std)


class RandomSource(abc.ABC):
    """One stream of randomness. Subclasses provide raw 64-bit words and raw bit strings.

    ``secure`` is ``True`` only for sources whose every bit comes from a CSPRNG.
    """

    secure: bool
    #: Whether :meth:`host_normal32` draws (and finishes) float32 host noise piece by piece.
    host_pieces: bool = False

    # -- primitives -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _raw_uint64(self, n: int) -> np.ndarray:
        """``n`` independent uniform 64-bit words (``uint64``)."""

    @abc.abstractmethod
    def random_bits(self, k: int) -> int:
        """A uniform integer in ``[0, 2**k)``."""

    @abc.abstractmethod
    def normal(
        self,
        shape: tuple[int, ...],
        std: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """A tensor of i.i.d. ``N(0, std²)`` noise, generated in ≥ float32 and cast to ``dtype``.

        ``dtype`` defaults to ``torch.float32``. Low-precision dtypes (bfloat16, float16) get noise
        drawn at full precision and rounded once, so the scale is right.
        """

    def host_normal32(
        self, numel: int, std: float, then: Callable[[np.ndarray, int, int], None] | None = None
    ) -> torch.Tensor | None:
        """``numel`` float32 ``N(0, std²)`` coordinates on the host drawn piece by piece, or ``None`` where
        this source has no such draw (then :meth:`normal` is the way, and ``then`` is not called).

        ``then(out, lo, hi)`` is called once the slice ``out[lo:hi]`` of the result (``out``: its numpy
        view) holds its noise, on the thread that drew it while it is still in the cache; slices are
        disjoint and may be finished concurrently. It may change the values it is handed (a DP release
        adds its clipped sum and rounds to its grid there), never values outside ``[lo, hi)``.
        """
        return None

    def host_release32(self, numel: int, std: float, then: Callable[[np.ndarray, int, int], None]) -> bool:
        """The draw of :meth:`host_normal32` without a result tensor: each chunk of its ``numel``
        coordinates is drawn into a scratch buffer of its own and handed to ``then(chunk, lo, hi)``
        (``chunk`` holds coordinates ``lo … hi − 1``; same noise, keys and thread rules as
        :meth:`host_normal32`), which must keep what it needs before returning (the buffer is reused).
        ``False`` where this source has no such draw (``then`` not called). A DP release written into
        the clipped sum's own memory uses it: no second model-sized buffer at the step's peak.
        """
        return False

    @abc.abstractmethod
    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 i.i.d. ``N(0, 1)`` samples as a numpy array."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state needed to continue this stream (JSON-serialisable)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` of the same kind of source."""

    # -- derived draws (shared by both sources) --------------------------------------------------
    def randbelow(self, n: int) -> int:
        """A uniform integer in ``[0, n)`` for any Python int ``n ≥ 1`` (exact, by rejection)."""
        if n <= 1:
            if n == 1:
                return 0
            raise InvalidParameterError("n", n, "there is no integer in an empty range", "pass n ≥ 1")
        k = n.bit_length()
        while True:
            v = self.random_bits(k)
            if v < n:
                return v

    def uniform(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 uniforms on ``[0, 1)``, on the grid ``k·2⁻⁵³`` (all 53 bits random)."""
        shape = _check_size(size)
        n = math.prod(shape)
        return ((self._raw_uint64(n) >> np.uint64(11)).astype(np.float64) * _INV_TWO_POW_53).reshape(shape)

    def integers(self, low: int, high: int, size: int | tuple[int, ...] | None = None) -> int | np.ndarray:
        """Uniform integers in ``[low, high)``: a Python int if ``size`` is None, else int64 array.

        Exact (rejection sampling, no modulo bias). Arrays need ``high - low ≤ 2**63``.
        """
        span = int(high) - int(low)
        if span < 1:
            raise InvalidParameterError(
                "high", high, f"[low={low}, high) is empty", "pass high > low (high is exclusive)"
            )
        if size is None:
            return int(low) + self.randbelow(span)
        shape = _check_size(size)
        if span > 1 << 63 or int(low) < -(1 << 63) or int(high) - 1 > (1 << 63) - 1:
            raise InvalidParameterError(
                "high", high, "array draws are int64", "keep low, high within int64 and high - low ≤ 2**63"
            )
        n = math.prod(shape)
        out = np.empty(n, dtype=np.uint64)
        limit = ((1 << 64) // span) * span  # accept x < limit: each residue equally often
        filled = 0
        while filled < n:
            need = n - filled
            x = self._raw_uint64(need + need // 8 + 1)
            if limit < 1 << 64:
                x = x[x < np.uint64(limit)]
            x = x[:need]
            out[filled : filled + x.size] = x % np.uint64(span)
            filled += x.size
        return (out.astype(np.int64) + np.int64(low)).reshape(shape)  # out < span ≤ 2**63: fits

    def bernoulli(self, n: int, p: float) -> np.ndarray:
        """A bool mask of length ``n``, each entry True independently with probability ``p̃ ≤ p``.

        ``p̃ = ⌊p·2⁵³⌋ / 2⁵³`` exactly (integer comparison of 53 random bits), so the realised
        inclusion probability is never above ``p`` and below it by < 2⁻⁵³: a Poisson sampler
        built on this is amplified at least as much as the rate it is accounted with.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidParameterError("n", n, "a mask length is a count", "pass an int ≥ 0")
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not (0.0 <= p <= 1.0):
            raise InvalidParameterError("p", p, "a probability must lie in [0, 1]", "pass 0 ≤ p ≤ 1")
        threshold = math.floor(float(p) * _TWO_POW_53)  # exact: scaling by a power of two
        k = self._raw_uint64(int(n)) >> np.uint64(11)
        return k < np.uint64(threshold) if threshold < _TWO_POW_53 else np.ones(int(n), dtype=bool)


class SeededSource(RandomSource):
    """Reproducible stream from ``seed`` (an int in ``[0, 2**64)``). Not for deployment.

    numpy draws use ``Generator(PCG64(seed))``; tensor draws use a ``torch.Generator`` per device,
    the CPU one seeded with ``seed`` itself, others with a seed derived from ``(seed, device)``.
    Tensor noise on an accelerator is therefore reproducible on that device type only.
    """

    secure = False

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not (0 <= seed <= _MAX_SEED):
            raise InvalidParameterError(
                "seed", seed, "a seed must be an integer in [0, 2**64)", "pass a non-negative int"
            )
        self.seed = int(seed)
        self._np = np.random.Generator(np.random.PCG64(self.seed))
        self._torch_gens: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"SeededSource(seed={self.seed})"

    def _raw_uint64(self, n: int) -> np.ndarray:
        return np.asarray(self._np.bit_generator.random_raw(n), dtype=np.uint64)

    def random_bits(self, k: int) -> int:
        if k <= 0:
            if k == 0:
                return 0
            raise InvalidParameterError("k", k, "a bit count cannot be negative", "pass k ≥ 0")
        words = (k + 63) // 64
        if words == 1:
            return int(self._np.bit_generator.random_raw()) >> (64 - k)
        v = int.from_bytes(self._raw_uint64(words).astype("<u8").tobytes(), "little")
        return v >> (64 * words - k)

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        return self._np.standard_normal(_check_size(size))

    def _torch_generator(self, device: Any) -> Any:
        import torch

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        gen = self._torch_gens.get(key)
        if gen is None:
            gen = torch.Generator(device=dev)
            if dev.type == "cpu":
                gen.manual_seed(self.seed)
            else:
                spawn = np.random.SeedSequence(self.seed, spawn_key=(zlib.crc32(key.encode()),))
                gen.manual_seed(int(spawn.generate_state(1, np.uint64)[0]))
            self._torch_gens[key] = gen
        return gen

    def normal(
        self,
        shape: tuple[int, ...],
        std: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        import torch

        std = _check_std(std)
        out_dtype = torch.float32 if dtype is None else dtype
        gen_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
        gen = self._torch_generator(device)
        z = torch.empty(_check_size(shape), dtype=gen_dtype, device=gen.device)
        z.normal_(0.0, std, generator=gen)  # scaled inside the sampler: no second pass
        return z if gen_dtype == out_dtype else z.to(out_dtype)

    def state_dict(self) -> dict[str, Any]:
        torch_states = {}
        for key, gen in self._torch_gens.items():
            torch_states[key] = bytes(gen.get_state().cpu().numpy().tobytes()).hex()
        return {
            "secure": False,
            "seed": self.seed,
            "numpy": self._np.bit_generator.state,
            "torch": torch_states,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the exact stream; generators absent from ``state`` restart fresh from the seed."""
        if not isinstance(state, Mapping) or state.get("secure") is not False or "numpy" not in state:
            raise InvalidParameterError(
                "state",
                state if not isinstance(state, Mapping) else dict(state).get("secure"),
                "a seeded stream can only resume from a seeded state_dict (a secure stream has no "
                "state to replay, and mixing them would silently change the run's randomness)",
                "load the state_dict saved by a SeededSource, or build a SecureSource",
            )
        seed = state.get("seed", self.seed)
        fresh = SeededSource(seed)
        try:
            fresh._np.bit_generator.state = state["numpy"]
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidParameterError(
                "state.numpy", "…", f"not a PCG64 state ({exc})", "pass an unmodified state_dict"
            ) from exc
        torch_states = state.get("torch", {}) or {}
        if torch_states:
            import torch

            for key, hexstate in torch_states.items():
                gen = fresh._torch_generator(key)
                raw = bytearray(bytes.fromhex(hexstate))
                gen.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
        self.seed = fresh.seed
        self._np = fresh._np
        self._torch_gens = fresh._torch_gens


class SecureSource(RandomSource):
    """Every bit from a CSPRNG: a ChaCha20 keystream keyed from ``os.urandom``; no seed, no replay.

    Bytes come from a :class:`~veil.mechanisms.keystream.ChaChaKeystream` (fresh OS key per
    Gaussian release, per 64 MiB and per forked process; see that module for the argument and its
    computational assumption). ``state_dict()`` is ``{"secure": True}``: a secure stream cannot
    be reproduced, by design, and pickling or copying a source gives a fresh one (no key travels).
    """

    secure = True
    host_pieces = True
    _NORMAL_CHUNK = 1 << 20

    def __init__(self) -> None:
        self._stream = ChaChaKeystream()
        self.release_keys = 0  # keys drawn for Gaussian releases (one each; tests check it, no secret)

    def __repr__(self) -> str:
        return "SecureSource()"

    def __reduce__(self) -> tuple[type[SecureSource], tuple[()]]:
        return (SecureSource, ())

    def _raw_uint64(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint64)
        if n:
            self._stream.fill(out)
        return out

    def random_bits(self, k: int) -> int:
        if k <= 0:
            if k == 0:
                return 0
            raise InvalidParameterError("k", k, "a bit count cannot be negative", "pass k ≥ 0")
        nbytes = (k + 7) // 8
        return int.from_bytes(self._stream.read(nbytes), "little") >> (8 * nbytes - k)

    def _polar_pairs(
        self, m: int, raw: Callable[[int], np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``m`` Box–Muller pairs ``(E, θ)`` from ``raw`` (default: this source's stream): ``E ~ Exp(1)``,
        ``θ`` uniform on [0, 2π)."""
        raw = self._raw_uint64 if raw is None else raw
        words = raw(2 * m)
        return exponential_from_words(words[:m], raw), angle_from_words(words[m:])

    def _release_stream(self) -> ChaChaKeystream:
        """A keystream of its own for one Gaussian release: a fresh OS key, shared with no other
        release and no other thread (a draw made ahead on a worker thread included)."""
        self.release_keys += 1
        return ChaChaKeystream()

    def standard_normal(self, size: int | tuple[int, ...]) -> np.ndarray:
        """float64 ``N(0, 1)`` by the Box–Muller transform of :meth:`normal` (fresh key per call)."""
        shape = _check_size(size)
        n = math.prod(shape)
        self._stream.rekey()
        e, theta = self._polar_pairs((n + 1) // 2)
        r = np.sqrt(2.0 * e)
        z = np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:n]
        return z.reshape(shape)

    def normal(
        self,
        shape: tuple[int, ...],
        std: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """CSPRNG Gaussian noise: one Box–Muller draw per coordinate, scaled (float32 or float64).

        Two transforms, both below: ``dtype=torch.float64`` gets the float64 transform described
        here (8 keystream bytes a coordinate, on the host); float32, bfloat16 and float16 get the
        float32 transform of :mod:`veil.mechanisms.box_muller` (4 bytes a coordinate, torch ops,
        several times faster; its docstring gives the argument why float32 arithmetic keeps this
        guarantee for noise that ends in float32 or coarser), made on ``device``: from the host
        keystream for the CPU, from the ChaCha20 of :mod:`veil.mechanisms.chacha_torch` run on the
        accelerator otherwise.

        **What is protected.** The noise of a Gaussian release (a DP-SGD step's ``N(0, σ²Δ²I)``,
        an adaptive-clipping count) must be (i) unpredictable: not recomputable from anything the
        run writes or any seed, and (ii) Gaussian at the resolution the release exposes. (i) is the
        keystream's job: a fresh OS key for every call (a keystream of the call's own, so one key
        never spans two releases, even when a worker thread draws the next step's noise while
        another release is drawn), for every forked process, and nothing of it in
        :meth:`state_dict` or a pickle. The guarantee
        therefore rests on ChaCha20's keystream being indistinguishable from uniform bytes to a
        computationally bounded adversary: it is a *computational* DP guarantee, as is every
        CSPRNG-based DP library's (``os.urandom`` itself is a ChaCha20 generator on Linux).

        **The transform** (8 keystream bytes per coordinate; two 64-bit words per pair):

        * radius: ``u ∈ (0, 1)`` is the float64 just below an exact uniform: its exponent is the
          number of leading zero bits (12 bits of the first word, and when all 12 are zero,
          12 more from a fresh word, and so on: the exponential is memoryless, so a fresh word is
          exactly the conditional law), its mantissa 52 further bits. So ``u`` has full float64
          relative precision at every scale, and ``E = −ln u`` is an ``Exp(1)`` variate correct to
          float64 rounding far into the tail: the radius ``r = √(2E)`` is **not truncated** at
          8.57 (53-bit uniforms) or 6.66 (32-bit uniforms); it reaches 37σ before a safety cap
          (hit with probability 2⁻¹⁰⁰⁸).
        * angle: ``θ = 2π·j·2⁻⁵³`` with ``j`` the top 53 bits of the second word; the pair gives
          ``r·cos θ`` and ``r·sin θ``, two independent ``N(0, 1)``, times ``std``, in float64.

        **Why one draw, no longer the sum of two.** The previous sampler summed two draws of
        ``std/√2`` for two reasons, both now covered. (a) Gaps: a raw float release can only take
        the values one transform reaches, and the Mironov (2012) certifier exploits values
        unreachable from a neighbouring input. DP-SGD now rounds every released coordinate to the
        power-of-two grid of :func:`veil.optimizer.release_grid` (step ``g ∈ (σ/512, σ/256]``),
        so what is observed is a grid cell; a single float64 draw has consecutive radii < 2e-8σ
        apart (2⁻⁵²σ/r beyond r = 1) and angle steps of 2π·2⁻⁵³·r, all ≪ g at every ``|z| ≤ 37σ``,
        so every cell is reachable from either neighbour (``tests/test_floating_point_attack.py``
        reruns the certifier on this sampler). (b) The tail: a sampler truncated at ``Rσ``
        certifies an input whenever the output lands beyond ``R`` plus the neighbour's shift ``Δ``;
        that happens with probability
        about ``Φ̄(R − Δ/σ)`` per sampled step, e.g. ``Φ̄(5.2) ≈ 1e-7`` for one 53-bit draw
        (R = 8.57) at noise multiplier 0.3, and ``Φ̄(3.3) ≈ 4e-4`` with 32-bit uniforms, which is
        why 32-bit uniforms are not used. The sum of two pushed ``R`` to 12.1; the
        unbounded-exponent radius pushes it to 37, so the truncation event has probability
        ``Φ̄(37 − Δ/σ)``: nil for any noise multiplier above 0.05.

        **Residual error.** The radius and angle grids (relative 2⁻⁵² and 2π·2⁻⁵³) and float64
        ``log``/``sqrt``/``cos``/``sin`` (a few ulp) move each grid cell's probability by a relative
        ≲ 1e-12 for ``|z| ≤ 10σ``: far below what the cast to the parameter dtype already moves
        (float32 rounding shifts a cell boundary by up to ``ulp32(z)/2 ≈ 3e-5·|z|/σ`` of a cell), and
        below anything a statistical test can see. Noise for bfloat16/float16 parameters is made at
        float32 by the optimizer and rounded once. The scalar and array mechanisms of
        :mod:`veil.mechanisms` do better still in secure mode: exact lattice sampling (see
        ``docs/mechanisms.md``).
        """
        import torch

        std = _check_std(std)
        out_dtype = torch.float32 if dtype is None else dtype
        dims = _check_size(shape)
        n = math.prod(dims)
        dev = torch.device(device)
        if out_dtype != torch.float64:  # float32, and bfloat16/float16 made at float32 and rounded once
            from veil.mechanisms.box_muller import normal_from_words

            if uses_device_keystream(dev):
                noise = torch.empty(n, dtype=torch.float32, device=dev)
                normal_from_words(noise, self._release_words(dev), std)
            else:
                noise = self.host_normal32(n, std)
            return (noise if out_dtype == torch.float32 else noise.to(out_dtype)).reshape(dims)
        out = torch.empty(n, dtype=out_dtype, device=dev)
        stream = self._release_stream()  # one key per release: the next release is independent of it
        raw = _words64(stream)
        for start in range(0, n, self._NORMAL_CHUNK):  # bounded memory for model-sized tensors
            k = min(self._NORMAL_CHUNK, n - start)
            m = (k + 1) // 2
            e, theta = self._polar_pairs(m, raw)
            r = torch.from_numpy(e).to(dev).mul_(2.0).sqrt_().mul_(std)
            angle = torch.from_numpy(theta).to(dev)
            seg = out[start : start + k]
            seg[:m].copy_(torch.cos(angle).mul_(r))
            seg[m:].copy_(angle.sin_().mul_(r)[: k - m])
        return out.reshape(dims)

    def host_normal32(
        self, numel: int, std: float, then: Callable[[np.ndarray, int, int], None] | None = None
    ) -> torch.Tensor:
        """The host's float32 draw of :meth:`normal` (same keys, transform and guarantee), with
        ``then`` run on each finished chunk (see :meth:`RandomSource.host_normal32`)."""
        import torch

        std = _check_std(std)
        noise = torch.empty(_check_size(numel), dtype=torch.float32)
        n = noise.numel()
        self._host_normal32(noise.numpy(), n, std, host_parts(n, torch.get_num_threads()), then)
        return noise

    def host_release32(self, numel: int, std: float, then: Callable[[np.ndarray, int, int], None]) -> bool:
        """See :meth:`RandomSource.host_release32`: :meth:`host_normal32`'s pieces, keys and transform."""
        import torch

        std = _check_std(std)
        (n,) = _check_size(numel)
        self._host_normal32(None, n, std, host_parts(n, torch.get_num_threads()), then)
        return True

    def _host_normal32(
        self,
        out: np.ndarray | None,
        n: int,
        std: float,
        parts: int,
        then: Callable[[np.ndarray, int, int], None] | None = None,
    ) -> None:
        """Fill ``out`` (``n`` coordinates) with float32 noise on the host, in ``parts`` contiguous
        pieces drawn in parallel; with ``out`` ``None``, each chunk goes to ``then(chunk, lo, hi)`` from
        a scratch buffer of its piece instead (:func:`_draw_piece`).

        Each piece is drawn from a keystream of its own under a fresh OS key (keyed here, on the
        calling thread, before any worker starts): one release may use several keys, never a key of
        another release or another piece, so the pieces are independent and the guarantee of
        :meth:`normal` holds piece by piece. numpy's transform (about three quarters of a draw's
        time) releases the GIL, so the pieces run on that many cores while the step waits for its
        noise; ``parts`` comes from :func:`host_parts` (public sizes and thread counts only).
        """
        import torch

        host = torch.device("cpu")
        if parts <= 1:
            _draw_piece(self._release_words(host), std, 0, n, out, then)
            return
        from concurrent.futures import ThreadPoolExecutor

        bounds = [n * i // parts for i in range(parts + 1)]
        pieces = [(lo, hi, self._release_words(host)) for lo, hi in itertools.pairwise(bounds)]
        with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="veil-noise") as pool:
            futures = [pool.submit(_draw_piece, words, std, lo, hi, out, then) for lo, hi, words in pieces]
            for done in futures:
                done.result()  # a failed piece fails the release

    def _release_words(self, device: torch.device) -> Callable[[int], Any]:
        """int32 keystream words for one release, made where the noise is needed, under a fresh key.

        On the host: numpy words from the ``cryptography`` ChaCha20 of :meth:`_release_stream`
        (:class:`_HostWords`: also written into a given buffer, so the host transform can take the
        words in its output's own memory). On
        an accelerator (:func:`uses_device_keystream`): tensors from the same cipher in torch ops on
        the device (:mod:`veil.mechanisms.chacha_torch`), keyed from ``os.urandom`` on the host, so
        the noise is never drawn on the host and copied.
        """
        if uses_device_keystream(device):
            from veil.mechanisms.chacha_torch import DeviceKeystream

            self.release_keys += 1
            return DeviceKeystream(device).words
        return _HostWords(self._release_stream())

    def state_dict(self) -> dict[str, Any]:
        return {"secure": True}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accepts only ``{"secure": True}``: a CSPRNG stream cannot be replayed or resumed."""
        if not isinstance(state, Mapping) or dict(state) != {"secure": True}:
            raise InvalidParameterError(
                "state",
                "seeded" if isinstance(state, Mapping) and state.get("secure") is False else state,
                "a secure source draws fresh OS randomness and cannot replay a stream; loading a "
                "seeded state into it would make the noise predictable",
                "resume with a SeededSource for a reproducible run, or pass {'secure': True}",
            )


_LN2 = math.log(2.0)
_EXP_BITS = 12  # leading bits of a radius word that set the exponent of u
_MANTISSA = np.uint64((1 << 52) - 1)
_HIDDEN = np.uint64(1 << 52)
_ANGLE_STEP = 2.0 * math.pi * 2.0**-53
_MAX_EXTRA_WORDS = 83  # 12 + 83·12 = 1008 exponent bits: u ≥ 2⁻¹⁰⁰⁹, r ≤ 37.4


def exponential_from_words(words: np.ndarray, more: Callable[[int], np.ndarray]) -> np.ndarray:
    """``E = −ln u`` (float64, an ``Exp(1)`` variate) per uint64 word, ``u`` uniform on (0, 1).

    ``u = 2⁻ᶻ·(1 + m/2⁵²)/2`` where ``z`` counts the leading zeros of the word's top 12 bits and
    ``m`` is its low 52 bits: that is the float64 ``⌊U⌋`` (rounded down to the float grid) of an
    exact uniform ``U``, with full relative precision at every scale. When the top 12 bits are all
    zero (probability 2⁻¹²) ``U < 2⁻¹²`` and, given that, ``2¹²·U`` is again uniform: a fresh word
    from ``more(count)`` continues the exponent. ``E = z·ln 2 − ln(1 + m/2⁵²)/2``, summed in that
    order (both terms ≥ 0: no cancellation).
    """
    words = np.asarray(words, dtype=np.uint64)
    e, pending = _exponential_parts(words)
    depth = 0
    while pending.size and depth < _MAX_EXTRA_WORDS:
        depth += 1
        extra = np.asarray(more(pending.size), dtype=np.uint64)
        e_extra, again = _exponential_parts(extra)
        e[pending] = e_extra + (_EXP_BITS * depth) * _LN2
        pending = pending[again]
    return e


def _exponential_parts(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(−ln u, indices whose top 12 bits were all zero)`` for each word taken on its own."""
    top = (words >> np.uint64(64 - _EXP_BITS)).astype(np.float64)  # 0 … 4095, exact
    # The biased float64 exponent of `top` is 1023 + ⌊log₂ top⌋ (0 for top = 0): leading zeros.
    zeros = np.minimum(1023 + _EXP_BITS - 1 - (top.view(np.int64) >> 52), _EXP_BITS)
    mantissa = (words & _MANTISSA | _HIDDEN).astype(np.float64) * 2.0**-53  # [0.5, 1), exact
    e = zeros * _LN2 - np.log(mantissa)
    return e, np.flatnonzero(top == 0.0)


def angle_from_words(words: np.ndarray) -> np.ndarray:
    """``θ = 2π·j·2⁻⁵³`` (float64) with ``j`` the top 53 bits of each uint64 word."""
    j = np.asarray(words, dtype=np.uint64) >> np.uint64(11)
    return j.astype(np.float64) * _ANGLE_STEP


#: Coordinates a host thread draws at least, when a secure float32 release is split across threads.
PARALLEL_PIECE = 1 << 21


def host_parts(n: int, threads: int) -> int:
    """Pieces a host release of ``n`` float32 coordinates is drawn in: one per thread torch may use,
    each at least :data:`PARALLEL_PIECE` coordinates (a thread costs more than a smaller draw)."""
    return max(1, min(threads, n // PARALLEL_PIECE))


def uses_device_keystream(device: torch.device) -> bool:
    """Whether secure noise for ``device`` is made there (torch ChaCha20) rather than on the host."""
    return device.type != "cpu"


def _draw_piece(
    words: Callable[[int], Any],
    std: float,
    lo: int,
    hi: int,
    out: np.ndarray | None,
    then: Callable[[np.ndarray, int, int], None] | None,
) -> None:
    """Coordinates ``lo … hi − 1`` of a host float32 draw from ``words`` (one key): into ``out[lo:hi]``,
    ``then(out, a, b)`` after each chunk; or, ``out`` ``None``, chunk by chunk into one scratch buffer
    handed to ``then(chunk, a, b)``. The chunks are :data:`~veil.mechanisms.box_muller.CHUNK` long
    either way and the transform reads ``words`` chunk after chunk, so both give the same values."""
    from veil.mechanisms.box_muller import CHUNK, normal_from_words

    if out is not None:
        done = None if then is None else (lambda a, b: then(out, lo + a, lo + b))
        normal_from_words(out[lo:hi], words, std, done)
        return
    assert then is not None
    scratch = np.empty(min(CHUNK, hi - lo), dtype=np.float32)
    for start in range(lo, hi, CHUNK):
        chunk = scratch[: min(CHUNK, hi - start)]
        normal_from_words(chunk, words, std)
        then(chunk, start, start + len(chunk))


class _HostWords:
    """One release's host keystream as int32 words: ``words(k)`` returns the next ``k`` in a fresh
    array, ``words.into(buf)`` writes the next ``len(buf)`` into ``buf`` (the same stream, in order)."""

    def __init__(self, stream: ChaChaKeystream) -> None:
        self._stream = stream

    def __call__(self, k: int) -> np.ndarray:
        buf = np.empty(k, dtype=np.int32)
        self.into(buf)
        return buf

    def into(self, buf: np.ndarray) -> None:
        if buf.size:
            self._stream.fill(buf)


def _words64(stream: ChaChaKeystream) -> Callable[[int], np.ndarray]:
    """``k ↦`` the next ``k`` uint64 words of ``stream``."""

    def raw(k: int) -> np.ndarray:
        out = np.empty(k, dtype=np.uint64)
        if k:
            stream.fill(out)
        return out

    return raw


def make_source(secure: bool, seed: int | None = None) -> RandomSource:
    """The randomness source for a run.

    * ``secure=True``: a :class:`SecureSource`. Passing a ``seed`` too is refused with
      :class:`~veil.errors.InvalidParameterError`: a seed promises a reproducibility the secure
      stream cannot give, and silently ignoring it would hide that.
    * ``secure=False`` with a seed: a :class:`SeededSource` on that seed.
    * ``secure=False`` without a seed: a fresh seed is drawn from the OS (63 bits) and exposed as
      ``source.seed``, so the run can be recorded and replayed. There is no fixed default seed.
    """
    if not isinstance(secure, bool):
        raise InvalidParameterError(
            "secure", secure, "the randomness mode must be explicit", "pass True or False"
        )
    if secure:
        if seed is not None:
            raise InvalidParameterError(
                "seed",
                seed,
                "a secure (CSPRNG) source cannot be seeded; a seed would suggest the noise is "
                "reproducible, and a reproducible noise is known to whoever knows the seed",
                "drop the seed for secure mode, or use secure=False for a reproducible research run",
            )
        return SecureSource()
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return SeededSource(seed)
