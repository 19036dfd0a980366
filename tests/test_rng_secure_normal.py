"""The secure Gaussian stream: ChaCha20 keystream, Box–Muller transform, tails, forks, key hygiene.

Two transforms are checked alike: the float64 one (64-bit words, float64 noise) and the float32 one
(32-bit words; float32/bf16/fp16 noise, on the host in numpy and on a device in torch, run here on the
CPU through the torch ChaCha20).

Statistical tests. Every check in :func:`misfits` is at α = 1e-7 and there are 13 of them, so one
call on a correct sampler fails with probability ≤ 1.3e-6. This file makes seven such calls on fresh
secure draws and two uniformity tests of keystream bytes at 1e-7 (the other statistical tests use
seeded words and are deterministic): it fails spuriously with probability < 1e-5 per run. The same
checks are run on deliberately broken samplers (built from seeded words, so deterministic), for both
transforms, and must reject every one (a std off by 2 % among them): the tests can fail.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from veil.mechanisms import SecureSource, box_muller, keystream
from veil.mechanisms import rng as rng_module
from veil.mechanisms.box_muller import angle_from_words32, exponential_from_words32
from veil.mechanisms.keystream import ChaChaKeystream
from veil.mechanisms.rng import angle_from_words, exponential_from_words

ALPHA = 1e-7
Z_CRIT = float(stats.norm.isf(ALPHA / 2))  # 5.33: a two-sided z-test at α
LN2 = math.log(2.0)
N = 1_000_000


def misfits(z: np.ndarray, std: float) -> list[str]:
    """The checks that ``z`` (even length; halves are the cos and sin of the same pairs) fails as i.i.d.
    ``N(0, std²)``, 13 checks each at α = 1e-7: moments, KS, a 64-bin χ², tails, and the pairs' angle,
    radius and independence."""
    x = np.asarray(z, dtype=np.float64) / std
    n = x.size
    failed = []
    if abs(x.mean()) * math.sqrt(n) > Z_CRIT:
        failed.append("mean")
    if abs((x**2).mean() - 1.0) / math.sqrt(2.0 / n) > Z_CRIT:  # Var(x²) = 2
        failed.append("variance")
    if abs((x**4).mean() - 3.0) / math.sqrt(96.0 / n) > Z_CRIT:  # Var(x⁴) = 105 − 9
        failed.append("fourth moment")
    if stats.kstest(x, "norm", method="asymp").pvalue < ALPHA:
        failed.append("ks")
    edges = stats.norm.ppf(np.linspace(0.0, 1.0, 65)[1:-1])
    counts = np.bincount(np.searchsorted(edges, x), minlength=64)
    if stats.chisquare(counts).pvalue < ALPHA:
        failed.append("chi2")
    for t in (2.0, 3.0, 4.0):  # expected beyond 4σ: 63 of 10⁶
        beyond = int((np.abs(x) > t).sum())
        law = stats.binom(n, 2.0 * stats.norm.sf(t))  # two-sided, by doubling the smaller tail
        if 2.0 * min(law.cdf(beyond), law.sf(beyond - 1)) < ALPHA:
            failed.append(f"tail {t:g}σ")
    a, b = x[: n // 2], x[n // 2 :]
    angle = np.arctan2(b, a)
    if stats.kstest(angle, "uniform", args=(-math.pi, 2.0 * math.pi), method="asymp").pvalue < ALPHA:
        failed.append("pair angle")
    if stats.kstest((a**2 + b**2) / 2.0, "expon", method="asymp").pvalue < ALPHA:
        failed.append("pair radius")
    for name, u, v in (("pair correlation", a, b), ("pair correlation of squares", a**2, b**2)):
        if abs(np.corrcoef(u, v)[0, 1]) * math.sqrt(n // 2) > Z_CRIT:
            failed.append(name)
    return failed


def _seeded_words(seed: int, width: int = 64) -> Callable[[int], np.ndarray]:
    """Seeded keystream stand-ins: uint64 words (the float64 transform) or int32 (the float32 one)."""
    gen = np.random.Generator(np.random.PCG64(seed))
    if width == 32:
        return lambda k: (
            np.asarray(gen.bit_generator.random_raw(k), dtype=np.uint64).astype(np.uint32).view(np.int32)
        )
    return lambda k: np.asarray(gen.bit_generator.random_raw(k), dtype=np.uint64)


def _pairs(words: Callable[[int], np.ndarray], m: int, width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    w = words(2 * m)
    if width == 32:
        e, theta = exponential_from_words32(w[:m], words), angle_from_words32(w[m:])
        return e.astype(np.float64), theta.astype(np.float64)
    return exponential_from_words(w[:m], words), angle_from_words(w[m:])


def _box_muller(e: np.ndarray, theta: np.ndarray) -> np.ndarray:
    r = np.sqrt(2.0 * e)
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])


# -- goodness of fit of the real stream -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_normal_is_gaussian(dtype: torch.dtype) -> None:
    std = 3.5
    z = SecureSource().normal((N,), std, dtype=dtype)
    assert z.dtype == dtype and z.shape == (N,) and bool(torch.isfinite(z).all())
    assert misfits(z.double().numpy(), std) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_normal_is_gaussian_across_chunks(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(SecureSource, "_NORMAL_CHUNK", 1001)  # odd chunks: pairs split at every boundary
    monkeypatch.setattr(box_muller, "CHUNK", 1001)
    z = SecureSource().normal((2, 100_000), 0.25, dtype=dtype).flatten().double().numpy()
    # The chunked layout interleaves cos and sin halves per chunk; the moment, CDF and tail checks
    # are layout-free (the pair checks then compare arbitrary halves, still independent).
    assert misfits(z, 0.25) == []


def test_a_release_split_across_threads_is_gaussian_with_a_key_per_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large host release is drawn in pieces on several threads: each piece its own fresh key."""
    monkeypatch.setattr(rng_module, "PARALLEL_PIECE", 1000)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert rng_module.host_parts(N, 3) == 3 and rng_module.host_parts(2999, 3) == 2
    src = SecureSource()
    keys = _count_keys(monkeypatch)
    z = src.normal((N,), 0.5).double().numpy()
    assert keys == [32] * 3 and src.release_keys == 3  # one OS key per piece, none shared
    assert misfits(z, 0.5) == []
    third = N // 3
    a, b = z[:third], z[third : 2 * third]
    assert not np.array_equal(a, b)
    assert abs(float(np.corrcoef(a, b)[0, 1])) < Z_CRIT / math.sqrt(third)  # independent pieces


def test_device_keystream_path_is_gaussian(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (torch ChaCha20 and the torch spelling of the transform), run on the CPU."""
    monkeypatch.setattr(rng_module, "uses_device_keystream", lambda device: True)
    src = SecureSource()
    z = src.normal((N,), 1.5)
    assert z.dtype == torch.float32 and src.release_keys == 1
    assert misfits(z.double().numpy(), 1.5) == []


def test_secure_standard_normal_is_gaussian() -> None:
    z = SecureSource().standard_normal((500, 400))
    assert z.shape == (500, 400) and z.dtype == np.float64
    assert misfits(z.ravel(), 1.0) == []


def test_secure_normal_edge_shapes_and_scales() -> None:
    src = SecureSource()
    assert src.normal((0,), 1.0).shape == (0,)
    assert src.normal((1,), 1.0).shape == (1,)
    assert src.normal((3, 0, 2), 1.0).shape == (3, 0, 2)
    assert torch.equal(src.normal((7,), 0.0), torch.zeros(7))
    assert src.standard_normal(3).shape == (3,) and src.standard_normal(0).shape == (0,)


# -- the checks have power: each deliberate error is rejected -------------------------------------
@pytest.mark.parametrize("width", [64, 32])
def test_the_checks_accept_the_transform_on_seeded_words(width: int) -> None:
    assert misfits(_box_muller(*_pairs(_seeded_words(1, width), N // 2, width)), 1.0) == []


@pytest.mark.parametrize(
    ("mutant", "expected"),
    [
        ("std x 1.02", "variance"),
        ("radius from a biased uniform u^1.02", "variance"),
        ("angle from a biased uniform u^1.02", "pair angle"),
        ("angle on half the circle", "mean"),
        ("both halves share one angle", "pair correlation of squares"),
    ],
)
@pytest.mark.parametrize("width", [64, 32])
def test_the_checks_reject_a_slightly_wrong_sampler(mutant: str, expected: str, width: int) -> None:
    """Each planted error, in the float64 (64-bit words) and the float32 (32-bit words) transform."""
    words = _seeded_words(2, width)
    m = N // 2
    e, theta = _pairs(words, m, width)
    if mutant == "std x 1.02":
        z = 1.02 * _box_muller(e, theta)
    elif mutant == "radius from a biased uniform u^1.02":
        z = _box_muller(1.02 * e, theta)  # −ln(u^1.02) = 1.02·E
    elif mutant == "angle from a biased uniform u^1.02":
        z = _box_muller(e, 2.0 * math.pi * (theta / (2.0 * math.pi)) ** 1.02)
    elif mutant == "angle on half the circle":
        z = _box_muller(e, theta / 2.0)
    else:  # both halves share one angle
        r1, r2 = np.sqrt(2.0 * e), np.sqrt(2.0 * _pairs(words, m, width)[0])
        z = np.concatenate([r1 * np.cos(theta), r2 * np.cos(theta)])
    # (A radius truncated at 6.66σ, as 32-bit uniforms give, moves 2e-10 of the mass: no sample of
    # the output can see it. test_a_truncated_radius_fails_the_tail_check is the test for that.)
    assert expected in misfits(z, 1.0), mutant


# -- the radius far into the tail ------------------------------------------------------------------
@pytest.mark.parametrize("width", [64, 32])
@pytest.mark.parametrize("levels", [1, 3, 8, 40])
def test_radius_is_exact_far_into_the_tail(levels: int, width: int) -> None:
    """Condition on ``U < 2^(−b·levels)`` by feeding words whose top ``b`` bits are zero (b = 12 for
    64-bit words, 9 for 32-bit): by the memoryless property ``E − b·levels·ln 2`` is again ``Exp(1)``
    (KS, seeded, α = 1e-7). ``levels = 40`` is the radius beyond 25.8σ (22.3σ), past any fixed-width
    uniform (64 bits stop at 9.42σ, 32 bits at 6.66σ)."""
    bits = 12 if width == 64 else 9
    assert _tail_excess_pvalue(levels, width) > ALPHA
    radius = np.sqrt(2.0 * (_tail_excess(levels, width) + bits * levels * LN2))
    assert radius.min() >= math.sqrt(2 * bits * levels * LN2) * (1 - 1e-6)


def _tail_excess(levels: int, width: int = 64, n: int = 20_000) -> np.ndarray:
    raw = _seeded_words(100 + levels, width)
    calls = 0
    bits = 12 if width == 64 else 9

    def low(k: int) -> np.ndarray:  # words whose top `bits` bits are zero
        w = raw(k)
        return w & w.dtype.type((1 << (width - bits)) - 1)

    def more(k: int) -> np.ndarray:
        nonlocal calls
        calls += 1
        return low(k) if calls < levels else raw(k)

    transform = exponential_from_words if width == 64 else exponential_from_words32
    return transform(low(n), more).astype(np.float64) - bits * levels * LN2


def _tail_excess_pvalue(levels: int, width: int = 64) -> float:
    return float(stats.kstest(_tail_excess(levels, width), "expon").pvalue)


@pytest.mark.parametrize("width", [64, 32])
def test_a_truncated_radius_fails_the_tail_check(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    # a radius word of 36 (27) bits at most
    monkeypatch.setattr(rng_module if width == 64 else box_muller, "_MAX_EXTRA_WORDS", 2)
    assert _tail_excess_pvalue(8, width) < ALPHA


# -- the keystream ---------------------------------------------------------------------------------
def test_keystream_is_rfc8439_chacha20_from_block_counter_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Known answer (RFC 8439 §2.4.2 key and nonce): our block 1 is the RFC's keystream block 1."""
    key = bytes(range(32))
    nonce = bytes.fromhex("000000000000004a00000000")
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: {32: key, 12: nonce}.get(n) or real(n))
    stream = ChaChaKeystream()
    out = stream.read(128)
    monkeypatch.undo()
    assert out[64:80].hex() == "224f51f3401bd9e12fde276fb8631ded"
    # The same bytes whether read at once or in pieces: the counter advances, never repeats.
    monkeypatch.setattr(os, "urandom", lambda n: {32: key, 12: nonce}.get(n) or real(n))
    pieces = ChaChaKeystream()
    assert pieces.read(5) + pieces.read(70) + pieces.read(53) == out


def test_keystream_rekeys_per_volume_and_per_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keystream, "REKEY_BYTES", 1 << 17)
    stream = ChaChaKeystream()
    first = stream.read(1 << 16)
    assert stream.rekeys == 1
    stream.read(1 << 19)  # crosses the lowered limit four times: a fresh key each time
    assert stream.rekeys == 5
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        src = SecureSource()
        keys = _count_keys(monkeypatch)
        for _ in range(3):
            src.normal((10,), 1.0, dtype=dtype)
        assert keys == [32] * 3 and src.release_keys == 3  # one fresh OS key per Gaussian release
        monkeypatch.undo()
        monkeypatch.setattr(keystream, "REKEY_BYTES", 1 << 17)
    assert len(first) == 1 << 16
    # Small reads (served from a buffered block) stay whole across re-keys by volume and by release.
    small = ChaChaKeystream()
    got = []
    for i in range(200):
        got.append(small.read(1 + i % 37))
        if i % 50 == 0:
            small.rekey()
    assert [len(g) for g in got] == [1 + i % 37 for i in range(200)]
    long_reads = [g for g in got if len(g) >= 8]
    assert small.rekeys == 1 + 4 and len(set(long_reads)) == len(long_reads)


def _count_keys(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the ``os.urandom`` calls that draw 32-byte keys from now on."""
    keys: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        if n == 32:
            keys.append(n)
        return real(n)

    monkeypatch.setattr(os, "urandom", counting)
    return keys


def test_keystream_bytes_are_uniform() -> None:
    data = np.frombuffer(ChaChaKeystream().read(1 << 20), dtype=np.uint8)
    assert stats.chisquare(np.bincount(data, minlength=256)).pvalue > ALPHA
    bits = np.unpackbits(data[: 1 << 16])
    assert stats.binomtest(int(bits.sum()), bits.size, 0.5).pvalue > ALPHA


# -- key hygiene: forks, copies, state -------------------------------------------------------------
def _draws(src: SecureSource) -> list[bytes]:
    return [
        src.uniform(8).tobytes(),
        src.random_bits(256).to_bytes(32, "little"),
        src.normal((8,), 1.0, dtype=torch.float64).numpy().tobytes(),
        src.standard_normal(8).tobytes(),
        src.bernoulli(256, 0.5).tobytes(),
    ]


def test_forked_child_and_parent_draw_different_noise() -> None:
    src = SecureSource()
    src.uniform(4)  # keyed before the fork: the child inherits a live cipher context ...
    src.random_bits(8)  # ... and a block of buffered keystream for small reads
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read_end)
            os.write(write_end, b"".join(_draws(src)))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        child = f.read()
    os.waitpid(pid, 0)
    parent = _draws(src)
    assert len(child) == sum(map(len, parent))
    pos = 0
    for part in parent:  # every kind of draw differs, including the buffered ones (uniform, bits)
        assert child[pos : pos + len(part)] != part
        pos += len(part)


def test_pid_check_rekeys_when_a_fork_skipped_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    src = SecureSource()
    src.uniform(1)
    keys = src._stream.rekeys
    monkeypatch.setattr(os, "getpid", lambda: -12345)
    src.uniform(1)
    assert src._stream.rekeys == keys + 1


def test_no_key_material_in_state_or_copies() -> None:
    src = SecureSource()
    src.normal((100,), 1.0)
    assert src.state_dict() == {"secure": True}
    json.dumps(src.state_dict())
    blob = pickle.dumps(src)
    assert len(blob) < 100 and b"cipher" not in blob  # a class reference: no key, no buffered bytes
    clones = [pickle.loads(blob), copy.deepcopy(src), copy.copy(src)]
    mine = src.uniform(16)
    for clone in clones:
        assert isinstance(clone, SecureSource) and clone._stream is not src._stream
        assert not np.array_equal(clone.uniform(16), mine)


def test_threads_never_share_keystream_bytes() -> None:
    src = SecureSource()
    out: list[np.ndarray] = []

    def work() -> None:
        for _ in range(200):
            out.append(src._raw_uint64(64))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    words = np.concatenate(out)
    assert words.size == 4 * 200 * 64 and np.unique(words).size == words.size


def test_import_veil_does_not_import_cryptography() -> None:
    code = "import sys, veil, veil.mechanisms; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _FedStream:
    """A stand-in keystream that hands out given words, in the order asked, and checks the sizes."""

    def __init__(self, words: list[np.ndarray]) -> None:
        self.words = words

    def fill(self, out: np.ndarray) -> None:
        given = self.words.pop(0)
        assert given.size == out.size and given.dtype.itemsize == out.dtype.itemsize
        out[:] = given.view(out.dtype)


def test_transform_matches_its_closed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Known words through ``SecureSource.normal`` (float64): (u = ½, θ = π/2), (u = 2⁻¹², θ = 0), then a
    radius word with 12 leading zeros continued by a fresh word (u = 2⁻¹²·¾, θ = 0), against the closed
    form ``std·√(−2 ln u)·(cos θ, sin θ)``."""
    half = np.uint64(1 << 63)  # top 12 bits 1000…: no leading zero, mantissa 0 → u = ½
    tiny = np.uint64(1 << 52)  # top 12 bits 0…01: 11 leading zeros → u = 2⁻¹²
    quarter_turn, zero_turn = np.uint64((1 << 51) << 11), np.uint64(0)
    words = [np.array([half, tiny, 0, quarter_turn, zero_turn, zero_turn], dtype=np.uint64)]
    words.append(np.array([(1 << 63) | (1 << 51)], dtype=np.uint64))  # continues the third radius: u' = ¾
    src = SecureSource()
    monkeypatch.setattr(src, "_release_stream", lambda: _FedStream(words))
    z = src.normal((6,), 2.0, dtype=torch.float64).numpy()
    r = 2.0 * np.sqrt(-2.0 * np.log([0.5, 2.0**-12, 0.75 * 2.0**-12]))
    expected = np.concatenate([r * np.cos([math.pi / 2, 0.0, 0.0]), r * np.sin([math.pi / 2, 0.0, 0.0])])
    np.testing.assert_allclose(z, expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("path", ["host", "device"])
def test_float32_transform_matches_its_closed_form(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The float32 transform on known 32-bit words, in numpy (host) and in torch (the device path):
    (u = ½, θ = π/2), (u = 2⁻⁹, θ = 0), then a radius word with 9 leading zeros continued by a fresh
    word (u = 2⁻⁹·¾, θ = π), against the closed form to float32 accuracy."""
    half, tiny = np.uint32(1 << 31), np.uint32(1 << 23)  # top 9 bits 1…: u = ½; 0…01: u = 2⁻⁹
    quarter_turn, half_turn = np.uint32(1 << 30), np.uint32(1 << 31)  # j = 2²² and 2²³ of 2²⁴
    words = [np.array([half, tiny, 0, quarter_turn, 0, half_turn], dtype=np.uint32)]
    words.append(np.array([(1 << 31) | (1 << 22)], dtype=np.uint32))  # continues the third radius: u' = ¾

    def feed(k: int) -> object:
        given = words.pop(0).view(np.int32)
        assert given.size == k
        return given if path == "host" else torch.from_numpy(given.copy())

    src = SecureSource()
    monkeypatch.setattr(rng_module, "uses_device_keystream", lambda device: path == "device")
    monkeypatch.setattr(src, "_release_words", lambda device: feed)
    z = src.normal((6,), 2.0).numpy()
    r = 2.0 * np.sqrt(-2.0 * np.log([0.5, 2.0**-9, 0.75 * 2.0**-9]))
    angles = [math.pi / 2, 0.0, math.pi]
    expected = np.concatenate([r * np.cos(angles), r * np.sin(angles)])
    np.testing.assert_allclose(z, expected, rtol=3e-6, atol=3e-6)


@pytest.mark.parametrize(
    ("n", "chunk"),
    [(1, 1 << 18), (7, 1 << 18), (1001, 1001), (100_003, 4097), (100_000, 4096), (300_001, 1 << 18)],
)
def test_host_transform_equals_the_generic_one_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, n: int, chunk: int
) -> None:
    """The host's in-place numpy transform (fewer passes, the secure draw's fast path) gives the same
    float32 values as the generic transform on the same words, continuations included, into an
    unaligned output: the fewer passes change no rounding."""
    monkeypatch.setattr(box_muller, "CHUNK", chunk)
    seeded = np.random.default_rng(7)
    pool = seeded.integers(-(2**31), 2**31, size=3 * n + 64, dtype=np.int64).astype(np.int32)
    pool[: min(len(pool), 3000) : 7] &= 0x007FFFFF  # top 9 bits zero: continued by fresh words
    pool[3 : min(len(pool), 3000) : 11] = 0

    def words() -> Callable[[int], np.ndarray]:
        pos = [0]

        def take(k: int) -> np.ndarray:
            out = pool[pos[0] : pos[0] + k].copy()
            pos[0] += k
            return out

        return take

    class Into:
        """Words that can also be written into a buffer (the secure source's kind): the host
        transform then takes each even chunk's words in the chunk's own output memory."""

        def __init__(self) -> None:
            self.take = words()

        def __call__(self, k: int) -> np.ndarray:
            return self.take(k)

        def into(self, buf: np.ndarray) -> None:
            buf[...] = self.take(len(buf))

    fast = np.empty(n + 3, dtype=np.float32)[3:]  # an output not aligned to its allocation
    in_place = np.empty(n + 3, dtype=np.float32)[3:]
    generic = np.empty(n, dtype=np.float32)
    box_muller.normal_from_words(fast, words(), 0.37)
    box_muller.normal_from_words(in_place, Into(), 0.37)
    box_muller._normal_from_words(generic, words(), 0.37, box_muller._NumpyOps)
    assert np.isfinite(fast).all() and np.array_equal(fast, generic)
    assert np.array_equal(in_place, generic)


def test_secure_noise_bench_runs() -> None:
    """``bench/secure_noise.py`` (draws and interleaved steps, with the previous sampler as baseline) still
    runs: tiny settings."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "secure_noise.py"
    cmd = [sys.executable, str(script), "--sizes", "11", "--rounds", "1", "--steps", "1", "--configs", "mlp"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "| 11 | secure (ChaCha20, one draw) |" in out and "| 11 | previous secure" in out
    assert "| mlp | veil |" in out and "| mlp | veil-urandom |" in out
