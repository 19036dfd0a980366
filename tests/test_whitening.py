"""The scattering preset's DP whitening (veil.data.whitening): the rows' norm bound, the Gram release's
noise (symmetric, std S, on the grid), the fold into the released layer, and its accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from veil.accounting.events import Gaussian
from veil.data.whitening import WhiteningPlan, fold_, gram_of_rows, release_gram, whiten_rows_, whitener
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.models.scattering import UnitRows, unit_rows_net
from veil.optimizer import release_grid
from veil.presets import whitening_for

PARTS = [(9, 2, 2), (6, 3, 3)]  # 36 + 54 coordinates: two "scales" as MultiScaleScattering lays them out


def _raw_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 4, n, dtype=torch.float32)[:, None]  # rows of every size, 1e-3 to 1e4
    return torch.randn(n, 90, generator=g) * scales + 5.0


def test_unit_rows_have_norm_at_most_one_whatever_the_record() -> None:
    """The Gram release's sensitivity (1) rests on ‖z‖ ≤ 1 for every row: fails if the scaling is dropped."""
    rows = UnitRows(PARTS, 0.3)
    x = torch.cat([_raw_rows(256, 0), torch.zeros(1, 90), torch.full((1, 90), 7.0)])  # blank rows too
    z = rows(x)
    assert z.shape == (len(x), rows.out_features) == (len(x), 91)
    assert float(z.norm(dim=1).max()) <= 1.0 + 1e-6
    assert torch.allclose(z[:, -1], torch.full((len(x),), 0.3))


def test_gram_of_rows_scales_rows_above_one_down() -> None:
    rows = np.zeros((2, 3), dtype=np.float32)
    rows[0] = [3.0, 4.0, 0.0]  # norm 5: counted as norm 1
    rows[1] = [0.0, 0.0, 0.5]
    gram = gram_of_rows(rows, chunk=1)
    np.testing.assert_allclose(gram, np.outer([0.6, 0.8, 0], [0.6, 0.8, 0]) + np.diag([0, 0, 0.25]), atol=1e-6)


def test_released_gram_is_symmetric_with_noise_std_s_on_the_grid() -> None:
    """Upper triangle drawn once (std S per coordinate), mirrored, rounded to the release grid.

    Statistical part: the m = d(d+1)/2 = 20,100 upper-triangle noise values are i.i.d. N(0, S²) (seeded,
    so the test is deterministic); their sample std s has s/S − 1 ≈ N(0, 1/(2m)), sd 0.005. The bound
    |s/S − 1| < 0.03 is 6 sd: a false failure rate of ~2e-9 for an unseeded draw. With std × 2 the
    ratio is 2 and the test fails."""
    d, s = 200, 2.5
    rows = np.zeros((10, d), dtype=np.float32)
    gram = release_gram(rows, s, SeededSource(11))
    assert gram.dtype == np.float32
    np.testing.assert_array_equal(gram, gram.T)
    upper = gram[np.triu_indices(d)].astype(np.float64)
    ratio = upper.std() / s
    assert abs(ratio - 1) < 0.03, ratio
    assert abs(upper.mean()) < 6 * s / math.sqrt(upper.size)
    grid = release_grid(s)
    np.testing.assert_array_equal(np.rint(upper / grid) * grid, upper)
    # rows' draws are independent (not one row's draw reused): sample correlation ~ N(0, 1/198), 6 sd
    assert abs(np.corrcoef(gram[0, 2:], gram[1, 2:])[0, 1]) < 6 / math.sqrt(d - 2)


def test_released_gram_with_secure_noise() -> None:
    rows = np.eye(4, 30, dtype=np.float32)
    gram = release_gram(rows, 1.0, SecureSource())
    np.testing.assert_array_equal(gram, gram.T)
    assert 0.5 < float(np.std(gram[np.triu_indices(30)])) < 1.5


def test_whitener_is_the_inverse_square_root_and_scales_rows_to_the_target_norm() -> None:
    g = np.random.default_rng(0)
    z = g.standard_normal((500, 20)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    gram = gram_of_rows(z)
    p, c = whitener(gram.astype(np.float32), 500, 0.01, 60.0)
    np.testing.assert_allclose(p, p.T, atol=1e-6)
    np.testing.assert_allclose(p @ (gram / 500 + 0.01 * np.eye(20)) @ p, np.eye(20), atol=1e-4)
    rows = z.copy()
    whiten_rows_(rows, p, c, chunk=7)
    np.testing.assert_allclose(rows, c * z @ p, rtol=1e-5, atol=1e-5)
    rms = math.sqrt(float(np.mean(np.sum(rows.astype(np.float64) ** 2, axis=1))))
    assert rms == pytest.approx(60.0, rel=1e-3)  # c from the (here noise-free) released Gram: exact


def test_folded_layer_on_unit_rows_equals_the_whitened_model() -> None:
    """W' = c·W·P acting on z gives the logits of the trained layer on c·zP (float rounding only):
    fails if the scale or P is left out of the fold."""
    torch.manual_seed(0)
    z = UnitRows(PARTS, 0.3)(_raw_rows(64, 1))
    noisy = gram_of_rows(z.numpy()) + np.random.default_rng(1).standard_normal((91, 91)) * 0.1
    noisy = ((noisy + noisy.T) / 2).astype(np.float32)
    p, c = whitener(noisy, 64, 0.05, 60.0)
    layer = torch.nn.Linear(91, 10)
    whitened = z.numpy().copy()
    whiten_rows_(whitened, p, c)
    expected = layer(torch.from_numpy(whitened))
    fold_(layer, p, c)
    torch.testing.assert_close(layer(z), expected, rtol=1e-4, atol=1e-3)


def test_unit_rows_net_replaces_the_head_only() -> None:
    from veil.models import FixedFeaturesThenHead, build_model

    net = unit_rows_net(build_model("scatternet", (1, 28, 28), 10, "image"))
    assert isinstance(net, FixedFeaturesThenHead)
    assert isinstance(net.head, torch.nn.Linear) and net.head.in_features == 81 * 49 + 9 * 196 + 1
    assert not list(net.features.parameters())


def test_only_the_scattering_preset_whitens_and_its_release_comes_first() -> None:
    assert whitening_for("image-scatternet", "scatternet", (1, 28, 28)) == {
        "std": 6.0,
        "ridge": 0.02,
        "row_norm": 60.0,
    }
    assert whitening_for("image", "cnn", (1, 28, 28)) is None
    assert whitening_for("image-rff", "rff", (1, 8, 8)) is None
    assert whitening_for("image-scatternet", "scatternet", (1, 12, 12)) is None
    assert WhiteningPlan(6.0, 0.02, 60.0).event == Gaussian(6.0)
