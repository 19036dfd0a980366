"""The fixed scattering front end and training a model whose fixed features are precomputed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from veil.models import FixedFeaturesThenHead, build_model
from veil.models.scattering import Scattering2d, scattering_channels, scattering_features


def _circular_lowpass_reference(u: np.ndarray, J: int, out_hw: tuple[int, int]) -> np.ndarray:
    """u ⋆ φ_J by a direct circular sum over all pixel pairs, kept every 2^J pixels from pixel 2^J."""
    rows, cols = u.shape
    sigma, step = 0.8 * 2**J, 2**J
    out = np.zeros(out_hw)
    weights = np.zeros((rows, cols))
    for r in range(rows):
        for c in range(cols):
            dr = min(r, rows - r)
            dc = min(c, cols - c)
            weights[r, c] = sum(
                math.exp(-((dr + a * rows) ** 2 + (dc + b * cols) ** 2) / (2 * sigma**2))
                for a in (-2, -1, 0, 1, 2)
                for b in (-2, -1, 0, 1, 2)
            )
    weights /= weights.sum()
    for i in range(out_hw[0]):
        for k in range(out_hw[1]):
            ci, ck = step * (i + 1), step * (k + 1)
            for r in range(rows):
                for c in range(cols):
                    out[i, k] += u[r, c] * weights[(ci - r) % rows, (ck - c) % cols]
    return out


def test_shapes_channels_and_no_parameters() -> None:
    assert (
        scattering_channels(2, 8) == 81 and scattering_channels(1, 8) == 9 and scattering_channels(3, 4) == 61
    )
    for shape, J, hw in (((1, 28, 28), 2, (7, 7)), ((3, 8, 8), 1, (4, 4)), ((1, 20, 30), 2, (5, 8))):
        m = Scattering2d(shape, J=J)
        out = m(torch.rand(5, *shape))
        assert out.shape == (5, shape[0] * scattering_channels(J, 8), *hw)
        assert not list(m.parameters()) and not m.state_dict()  # filters are rebuilt, not saved
        assert torch.isfinite(out).all()


def test_each_example_is_mapped_on_its_own() -> None:
    """The privacy precondition: an example's features do not depend on the rest of the batch."""
    m = Scattering2d((1, 28, 28))
    x = torch.rand(6, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    together = m(x)
    alone = torch.cat([m(x[i : i + 1]) for i in range(6)])
    assert torch.allclose(together, alone, atol=1e-6)
    changed = x.clone()
    changed[3] = torch.rand(1, 28, 28)
    assert torch.allclose(m(changed)[[0, 1, 2, 4, 5]], together[[0, 1, 2, 4, 5]], atol=1e-6)


def test_wavelets_have_zero_mean_and_constant_image_gives_only_order_zero() -> None:
    m = Scattering2d((1, 16, 16), J=2)
    assert float(m.psi[:, 0, 0].abs().max()) < 1e-6  # ψ̂(0) = 0: a wavelet sees no constant
    out = m(torch.full((1, 1, 16, 16), 0.7, dtype=torch.float64))
    assert torch.allclose(out[0, 0], torch.full((4, 4), 0.7, dtype=torch.float64), atol=1e-9)
    assert float(out[0, 1:].abs().max()) < 1e-6


def test_orders_zero_and_one_match_a_direct_circular_convolution() -> None:
    """The FFT and matrix low-pass against direct sums on the padded image (float64)."""
    rng = np.random.default_rng(1)
    img = rng.random((8, 8))
    m = Scattering2d((1, 8, 8), J=1, L=4)
    padded = np.pad(img, 2, mode="reflect")  # 12 × 12
    out = m(torch.from_numpy(img).reshape(1, 1, 8, 8)).numpy()[0]
    assert np.allclose(out[0], _circular_lowpass_reference(padded, 1, (4, 4)), atol=1e-10)
    psi = np.fft.ifft2(m.psi.to(torch.complex128).numpy())  # spatial filters
    for k in range(4):
        conv = np.zeros((12, 12), dtype=np.complex128)
        for r in range(12):
            for c in range(12):
                conv[r, c] = sum(
                    padded[a, b] * psi[k, (r - a) % 12, (c - b) % 12] for a in range(12) for b in range(12)
                )
        ref = _circular_lowpass_reference(np.abs(conv), 1, (4, 4))
        assert np.allclose(out[1 + k], ref, atol=1e-6)


def _circular_convolution(u: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Σ_ab u[a, b]·f[(r − a) mod n, (c − b) mod m], summed directly (no FFT)."""
    n, m = u.shape
    rows, cols = np.arange(n), np.arange(m)
    out = np.zeros((n, m), dtype=np.complex128)
    for a in range(n):
        for b in range(m):
            out += u[a, b] * f[np.ix_((rows - a) % n, (cols - b) % m)]
    return out


def test_order_two_matches_a_full_resolution_direct_computation() -> None:
    """||x ⋆ ψ_j1| ⋆ ψ_j2| ⋆ φ_J by direct sums at full resolution, against the module's FFT
    version, which computes |· ⋆ ψ_j2| on the coarser 2^j2 grid (an approximation: on these images
    within 5% of each channel's largest coefficient, 1% on average; a wrong angle or scale in the
    second filter is off by 10–90%)."""
    J, L = 2, 4
    rng = np.random.default_rng(3)
    digit = np.zeros((12, 12))
    digit[2:10, 2:10] = load_digits().images[7] / 16.0
    for img in (rng.random((12, 12)), digit):
        m = Scattering2d((1, 12, 12), J=J, L=L)
        out = m(torch.from_numpy(img).reshape(1, 1, 12, 12)).numpy()[0]
        padded = np.pad(img, 2**J, mode="reflect")  # 20 × 20
        psi = np.fft.ifft2(m.psi.to(torch.complex128).numpy())
        channel, errors = 1 + J * L, []
        for theta1 in range(L):  # j1 = 0, j2 = 1: the only pair when J = 2
            u1 = np.abs(_circular_convolution(padded, psi[theta1]))
            for theta2 in range(L):
                u2 = np.abs(_circular_convolution(u1, psi[L + theta2]))
                ref = _circular_lowpass_reference(u2, J, out.shape[1:])
                errors.append(np.abs(out[channel] - ref).max() / np.abs(ref).max())
                channel += 1
        assert channel == out.shape[0]
        assert max(errors) < 0.07 and float(np.mean(errors)) < 0.02


def test_scattering_features_batches_like_the_module() -> None:
    x = np.random.default_rng(2).random((7, 1, 28, 28)).astype(np.float32)
    got = scattering_features(x, batch_size=3)
    want = Scattering2d((1, 28, 28))(torch.from_numpy(x)).numpy()
    assert got.dtype == np.float32 and np.allclose(got, want, atol=1e-6)


def test_scatternet_model_is_a_fixed_front_and_a_head() -> None:
    net = build_model("scatternet", (1, 28, 28), 10, "image")
    assert isinstance(net, FixedFeaturesThenHead)
    assert not list(net.features.parameters()) and list(net.head.parameters())
    assert net(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("auto", (1, 28, 28), 10, "image").__class__ is FixedFeaturesThenHead
    with pytest.raises(ValueError):
        FixedFeaturesThenHead(torch.nn.Linear(2, 2), torch.nn.Identity())


def test_scatternet_on_28x28_is_both_scales_each_group_normalised_then_linear() -> None:
    """The front is J = 2 and J = 1 side by side (81 × 7 × 7 then 9 × 14 × 14 per image); the head cuts
    each scale back out of the row in that order, group-normalises it (27 and 3 groups) and applies one
    linear layer: equal to the same computation written out by hand on the two transforms."""
    from torch.nn import functional as F

    from veil.models.scattering import MultiScaleScattering, ScatteringHead

    torch.manual_seed(0)
    net = build_model("scatternet", (1, 28, 28), 10, "image")
    assert isinstance(net.features, MultiScaleScattering) and isinstance(net.head, ScatteringHead)
    assert net.features.parts == [(81, 7, 7), (9, 14, 14)]
    with torch.no_grad():
        for norm in net.head.norms:  # non-trivial affine parameters, so a swapped part would show
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.uniform_(-1.0, 1.0)
        x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
        j2, j1 = Scattering2d((1, 28, 28), J=2)(x), Scattering2d((1, 28, 28), J=1)(x)
        n2, n1 = net.head.norms
        by_hand = torch.cat(
            [
                F.group_norm(j2, 27, n2.weight, n2.bias, n2.eps).flatten(1),
                F.group_norm(j1, 3, n1.weight, n1.bias, n1.eps).flatten(1),
            ],
            dim=1,
        )
        want = net.head.linear(by_hand)
        assert net.features(x).shape == (3, 81 * 49 + 9 * 196)
        assert torch.allclose(net(x), want, atol=1e-5)
        alone = torch.cat([net(x[i : i + 1]) for i in range(3)])
        assert torch.allclose(alone, want, atol=1e-5)  # each example on its own
    assert not list(build_model("scatternet", (1, 8, 8), 10, "image").features.parameters())


@pytest.mark.parametrize("name", ["scatternet", "rff"])
def test_train_fixed_front_releases_a_full_model_reproducing_the_accuracy(name: str, tmp_path: Path) -> None:
    """Training runs on precomputed features; the released weights map raw images to the same result."""
    import veil
    from veil.config import make_config
    from veil.data import load_dataset
    from veil.data.preprocess import build_transform, plan_preprocessing

    report = veil.train(
        {"dataset": "digits", "model": name, "epochs": 2, "out": str(tmp_path / "run"), "seed": 3},
        progress=False,
    )
    assert report.model == name and all(c.passed for c in report.checks)
    assert report.epsilon_spent <= 3.0 and report.baseline_test_accuracy is not None
    data = load_dataset("digits", seed=3)
    model = torch.nn.Sequential()
    model.add_module(
        "preprocess", build_transform(plan_preprocessing(make_config({}), data), data.input_shape)
    )
    # A different torch seed: the random features must come from model.pt, not from a rebuild.
    torch.manual_seed(12345)
    model.add_module("net", build_model(name, data.input_shape, data.num_classes, data.kind))
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x_test)).argmax(1).numpy()
    assert math.isclose(float((pred == data.y_test).mean()), report.test_accuracy, abs_tol=1e-9)


class _BatchCentred(torch.nn.Module):
    """A parameter-free 'feature map' that subtracts the batch mean: it mixes examples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


def mixing_front(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    flat = math.prod(input_shape)
    head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(flat, num_classes))
    return FixedFeaturesThenHead(_BatchCentred(), head)


def mixing_plain(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    flat = math.prod(input_shape)
    return torch.nn.Sequential(_BatchCentred(), torch.nn.Flatten(), torch.nn.Linear(flat, num_classes))


@pytest.mark.parametrize("factory", ["mixing_front", "mixing_plain"])
def test_train_refuses_a_model_that_mixes_examples(
    factory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that mixes examples is refused before anything is written, also inside a fixed
    front (whose precomputed features the engine never sees)."""
    import veil
    from veil.errors import ModelNotSupportedError

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    config = {
        "dataset": "digits",
        "model": f"test_scattering:{factory}",
        "epochs": 1,
        "out": str(tmp_path / "r"),
    }
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        veil.train(config, progress=False)
    assert not (tmp_path / "r").exists()


class _CountingFront(torch.nn.Module):
    """A parameter-free flattening front that counts its forward calls."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CountingFront.calls += 1
        return x.flatten(1)


def counting_front(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    return FixedFeaturesThenHead(_CountingFront(), torch.nn.Linear(math.prod(input_shape), num_classes))


def test_audit_trains_a_fixed_front_model_on_features_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit trains like veil train: the front runs once over the records (plus the mixing
    probe and the attacks' evaluations), not at each of the 48 steps."""
    from veil.audit.run import AuditSettings, audit

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(_CountingFront, "calls", 0)
    import test_scattering  # the module the factory path imports (same file, maybe a second copy)

    monkeypatch.setattr(test_scattering._CountingFront, "calls", 0)
    report = audit(
        {"dataset": "digits", "model": "test_scattering:counting_front", "seed": 0},
        AuditSettings(canaries=50),
        write=False,
    )
    assert report.run is not None and report.run["steps"] == 48
    assert report.epsilon_lower_bound is not None and report.verdict == "consistent"
    calls = sum(cls.calls for cls in {_CountingFront, test_scattering._CountingFront})
    assert 0 < calls < 20  # 55 when the front ran at every step


def test_audit_refuses_a_front_that_mixes_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    from veil.audit.run import AuditSettings, audit
    from veil.errors import ModelNotSupportedError

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        audit({"dataset": "digits", "model": "test_scattering:mixing_front"}, AuditSettings(), write=False)
