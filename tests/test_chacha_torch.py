"""ChaCha20 in torch integer ops (veil.mechanisms.chacha_torch), the keystream of secure noise on a GPU.

Checked on the CPU (the same torch ops run on any device): RFC 8439's test vectors, agreement with the
``cryptography`` package's ChaCha20 (an independent implementation) across the signed-int32 counter
boundary, the counter's end, and the key hygiene of a device keystream (fresh OS key per stream, never
carried across a fork, never pickled). The statistical tests of the noise made from it are in
test_rng_secure_normal.py (``test_device_keystream_path_is_gaussian``).
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from veil.mechanisms.chacha_torch import DeviceKeystream, chacha20_blocks

RFC_KEY = bytes(range(32))


def _bytes(blocks: torch.Tensor) -> bytes:
    return blocks.numpy().astype("<i4").tobytes()


def _reference(key: bytes, nonce: bytes, counter: int, blocks: int) -> bytes:
    initial = counter.to_bytes(4, "little") + nonce
    return Cipher(algorithms.ChaCha20(key, initial), mode=None).encryptor().update(bytes(64 * blocks))


@pytest.mark.parametrize(
    ("key", "nonce", "counter", "block"),
    [
        (  # RFC 8439 §2.3.2: the block function's test vector
            RFC_KEY,
            "000000090000004a00000000",
            1,
            "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
            "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e",
        ),
        (  # RFC 8439 A.1, test vector #1: all-zero key and nonce, counter 0
            bytes(32),
            "000000000000000000000000",
            0,
            "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
            "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586",
        ),
        (  # RFC 8439 A.1, test vector #2: counter 1
            bytes(32),
            "000000000000000000000000",
            1,
            "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
            "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f",
        ),
    ],
    ids=["2.3.2", "A.1 #1", "A.1 #2"],
)
def test_rfc8439_block_vectors(key: bytes, nonce: str, counter: int, block: str) -> None:
    assert _bytes(chacha20_blocks(key, bytes.fromhex(nonce), counter, 1)).hex() == block


def test_rfc8439_keystream_of_the_encryption_example() -> None:
    """RFC 8439 §2.4.2: the keystream from counter 1 starts with 224f51f3…; several blocks at once."""
    out = _bytes(chacha20_blocks(RFC_KEY, bytes.fromhex("000000000000004a00000000"), 1, 2))
    assert out[:16].hex() == "224f51f3401bd9e12fde276fb8631ded"
    assert out[64:80].hex() == "69a6749f3f630f4122cafe28ec4dc47e"


@pytest.mark.parametrize("counter", [0, 7, (1 << 31) - 3, (1 << 32) - 5])
def test_agrees_with_the_cryptography_package(counter: int) -> None:
    """Random key and nonce, many blocks, including counters past 2³¹ (negative as int32)."""
    key, nonce = os.urandom(32), os.urandom(12)
    assert _bytes(chacha20_blocks(key, nonce, counter, 5)) == _reference(key, nonce, counter, 5)


def test_the_counter_never_wraps() -> None:
    with pytest.raises(ValueError, match="wrap"):
        chacha20_blocks(bytes(32), bytes(12), (1 << 32) - 1, 2)


def test_device_keystream_is_one_fresh_key_read_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Words in order are the keystream from counter 0 (pieces of any size, no block read twice);
    each stream draws its own key and nonce from the OS."""
    key, nonce = os.urandom(32), os.urandom(12)
    asked: list[int] = []

    def urandom(n: int) -> bytes:
        asked.append(n)
        return {32: key, 12: nonce}[n]

    monkeypatch.setattr(os, "urandom", urandom)
    stream = DeviceKeystream("cpu")
    words = torch.cat([stream.words(16), stream.words(5), stream.words(40)])
    monkeypatch.undo()
    assert asked == [32, 12]
    expected = torch.frombuffer(bytearray(_reference(key, nonce, 0, 5)), dtype=torch.int32)
    assert torch.equal(words[:21], expected[:21])  # 16 words = block 0; 5 from block 1 ...
    assert torch.equal(words[21:], expected[32:72])  # ... whose rest is dropped: the next read is block 2
    assert not torch.equal(DeviceKeystream("cpu").words(16), DeviceKeystream("cpu").words(16))


def test_device_keystream_is_never_carried_across_a_fork_or_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = DeviceKeystream("cpu")
    with pytest.raises(TypeError):
        pickle.dumps(stream)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a forked child
    with pytest.raises(RuntimeError, match="fork"):
        stream.words(4)


def test_gpu_noise_bench_runs_its_checks_on_the_cpu() -> None:
    """``bench/secure_noise_gpu.py`` (for a session with a GPU) runs: here on the CPU, tiny settings."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "secure_noise_gpu.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--sizes", "1000", "--rounds", "1", "--steps", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "keystream checks: all passed" in out and "| 1,000 | torch.randn |" in out
