"""Random Fourier features: the kernel they approximate, their norm, and the per-example contract."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veil.models import RFF_SCALE, FixedFeaturesThenHead, build_model, resolve_name
from veil.models.random_features import RandomFourierFeatures


def test_inner_products_approximate_the_gaussian_kernel() -> None:
    """⟨φ(x), φ(y)⟩/a² is a mean of D terms cos(w·(x−y)) + cos(w·(x+y)+2b), each in [−2, 2], whose
    expectation is exp(−γ‖x−y‖²). Hoeffding: a deviation ≥ 0.05 with D = 20,000 has probability
    ≤ 2·exp(−D·0.05²/8) < 1e-5 per pair (the seed is fixed, so the test is deterministic)."""
    gen = torch.Generator().manual_seed(0)
    d, gamma, scale = 64, 0.15, 3.0
    rff = RandomFourierFeatures(d, 20_000, gamma, scale=scale, generator=gen).double()
    x = torch.rand(12, d, generator=gen, dtype=torch.float64)
    phi = rff(x)
    got = phi @ phi.T / scale**2
    want = torch.exp(-gamma * torch.cdist(x, x) ** 2)
    assert float((got - want).abs().max()) < 0.05
    # The kernel is not trivially 0 or 1 on these inputs: the comparison has something to check.
    off_diagonal = want[~torch.eye(12, dtype=torch.bool)]
    assert float(off_diagonal.min()) > 0.05 and float(off_diagonal.max()) < 0.95


def test_feature_norm_is_the_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    rff = RandomFourierFeatures(64, 2000, 0.15, scale=3.0, generator=gen)
    norms = rff(torch.rand(50, 1, 8, 8, generator=gen)).norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, 3.0), rtol=0.1)


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=2**31 - 1), st.floats(min_value=-100.0, max_value=100.0))
def test_each_feature_is_bounded(seed: int, shift: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    rff = RandomFourierFeatures(5, 40, 0.3, scale=2.0, generator=gen)
    phi = rff(torch.rand(3, 5, generator=gen) + shift)
    assert float(phi.abs().max()) <= 2.0 * math.sqrt(2.0 / 40) * (1 + 1e-6)


def test_each_example_is_mapped_on_its_own() -> None:
    """The privacy argument for precomputing the features: no example's features depend on another."""
    gen = torch.Generator().manual_seed(2)
    rff = RandomFourierFeatures(64, 300, 0.15, generator=gen)
    x = torch.rand(6, 64, generator=gen)
    batch = rff(x)
    alone = torch.cat([rff(x[i : i + 1]) for i in range(6)])
    assert torch.allclose(batch, alone, atol=1e-6)
    changed = x.clone()
    changed[0] = torch.rand(64, generator=gen)
    assert torch.equal(rff(changed)[1:], batch[1:])


def test_the_map_is_fixed_state_not_parameters() -> None:
    rff = RandomFourierFeatures(4, 8, 1.0)
    assert not list(rff.parameters())
    assert set(rff.state_dict()) == {"frequencies", "phases"}
    again = RandomFourierFeatures(4, 8, 1.0)
    again.load_state_dict(rff.state_dict())
    x = torch.rand(2, 4)
    assert torch.equal(again(x), rff(x))
    double = rff(x.double())  # float64 in, float64 out (the clipping checks run in float64)
    assert double.dtype == torch.float64 and torch.allclose(double.float(), rff(x), atol=1e-6)
    with pytest.raises(ValueError):
        RandomFourierFeatures(4, 8, 0.0)


def test_rff_model_and_the_auto_choice() -> None:
    net = build_model("rff", (1, 8, 8), 10, "image")
    assert isinstance(net, FixedFeaturesThenHead) and isinstance(net.features, RandomFourierFeatures)
    assert net(torch.rand(3, 1, 8, 8)).shape == (3, 10)
    assert net.features.scale == RFF_SCALE
    assert resolve_name("auto", "image", (1, 8, 8)) == "rff"
    assert resolve_name("auto", "image", (1, 28, 28)) == "scatternet"
    assert resolve_name("auto", "table", (30,)) == "logreg"


def test_split_fixed_front_and_fixed_features() -> None:
    """The trainer's view of a fixed-front model: the head shares the model's parameters, and the
    front's features (empty input included) are what the whole model's front computes."""
    import numpy as np

    from veil.models import fixed_features, split_fixed_front

    net = build_model("rff", (1, 8, 8), 10, "image")
    model = torch.nn.Sequential(torch.nn.Identity(), net)
    front, head = split_fixed_front(model)
    assert front is not None and head is net.head
    assert {id(p) for p in head.parameters()} == {id(p) for p in model.parameters()}
    x = np.random.default_rng(0).random((5, 1, 8, 8)).astype(np.float32)
    feats = fixed_features(front, x, chunk=2)
    assert feats.dtype == np.float32 and np.allclose(
        feats, net.features(torch.from_numpy(x)).numpy(), atol=1e-6
    )
    assert fixed_features(front, x[:0]).shape == (0, 2000)
    plain = torch.nn.Sequential(torch.nn.Identity(), build_model("logreg", (1, 8, 8), 10, "image"))
    assert split_fixed_front(plain) == (None, plain)


def test_fixed_features_bounds_the_chunk_and_keeps_one_copy() -> None:
    """Feature extraction is chunked by a memory plan: the front never sees more than
    ``feature_chunk`` examples at once (167 for 28×28 images: the scattering transform's ≈ 1.3 MB of
    work per image stays near 256 MiB, not the 1,024-image chunks' ≈ 1.3 GB), and the chunks are
    written into one array, so no second copy of all features exists (a joined list held two)."""
    import tracemalloc

    import numpy as np

    from veil.models import FEATURE_CHUNK_BYTES, FRONT_WORK_PER_INPUT_BYTE, feature_chunk, fixed_features

    seen: list[int] = []

    class Doubler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(len(x))  # the output allocated by numpy, so tracemalloc sees it
            return torch.from_numpy(np.concatenate([x.numpy(), x.numpy()], axis=1).reshape(len(x), -1))

    x = np.random.default_rng(0).random((1000, 1, 28, 28)).astype(np.float32)
    chunk = feature_chunk(x.shape[1:])
    assert chunk == 167 and chunk * 28 * 28 * 4 * FRONT_WORK_PER_INPUT_BYTE <= FEATURE_CHUNK_BYTES
    assert feature_chunk((1, 8, 8)) == 1024 and feature_chunk((3, 4096, 4096)) == 1
    tracemalloc.start()
    try:
        feats = fixed_features(Doubler(), x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(seen) == chunk and sum(seen) == len(x)
    assert np.array_equal(feats, np.concatenate([x, x], axis=1).reshape(len(x), -1))
    # numpy's own allocations: the output (6.3 MB) plus a chunk's copy at most, never twice the output.
    assert peak < feats.nbytes + 2 * chunk * feats[0].nbytes + 2**20
