"""``--precision bf16``: the forward under bfloat16 autocast, clipping and noise in float32.

Reference: a naive per-example loop in float32 without autocast. Tolerance: bf16 keeps 8 significant
bits (unit roundoff u = 2⁻⁸ ≈ 3.9e-3); a few layers of matmuls and a norm compound it to well under
10u, so the clipped sum and the per-example norms must agree with the float32 loop to 3e-2 relative,
and must differ from it by more than 1e-5 (otherwise autocast did not run and the test proves nothing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.cli.main import main
from veil.clipping import PerSampleClipper
from veil.engine import PrivacyEngine
from veil.errors import ConfigError
from veil.precision import autocast

BF16_TOLERANCE = 3e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )


def _batch(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float) -> tuple[list, list[float]]:
    """Σ clip(g_i) and the norms ‖g_i‖, one example at a time, float32, no autocast."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(len(x)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
        norms.append(norm)
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, c / (norm + 1e-12))
    return total, norms


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True)))
    return num / math.sqrt(sum(float(b.square().sum()) for b in want))


def test_clipped_sum_under_bf16_autocast_matches_the_float32_loop() -> None:
    model = _model()
    x, y = _batch()
    _, norms = _reference(model, x, y, 1e9)
    c = sorted(norms)[len(norms) // 2]  # half the examples clipped
    want, want_norms = _reference(model, x, y, c)
    clipper = PerSampleClipper(model, c, loss_reduction="sum")
    try:
        with autocast("cpu", "bf16"):
            out = model(x)
        assert out.dtype == torch.bfloat16  # the forward did run in bf16
        F.cross_entropy(out.float(), y, reduction="sum").backward()
        got_norms = clipper.accumulate()
        got = clipper.clipped_sum()
    finally:
        clipper.remove()
    assert got_norms.dtype == torch.float32 and all(t.dtype == torch.float32 for t in got)
    assert torch.allclose(got_norms, torch.tensor(want_norms), rtol=BF16_TOLERANCE)
    error = _relative(got, want)
    assert 1e-5 < error <= BF16_TOLERANCE, error


def test_noise_is_added_to_float32_parameters_at_float32_resolution() -> None:
    """One private step under autocast: parameters stay float32 and the noise is float32 Gaussian.

    ``(θ − lr·Σclip/B − θ')·B/lr`` recovers the noise. Were it drawn (or added) in bf16, almost every
    coordinate would equal its bf16 rounding; float32 noise does so for ~2⁻¹⁶ of them. Its standard
    deviation must be σC: ~1,200 coordinates, a 10 % miss is 5 sd (false failure < 1e-6).
    """
    model = _model()
    x, y = _batch()
    lr, c, sigma = 0.5, 0.05, 2.0
    before = [p.detach().clone() for p in model.parameters()]
    want, _ = _reference(model, x, y, c)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(seed=3, reproducible=True)
    private, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),  # q = 1
        max_grad_norm=c,
        noise_multiplier=sigma,
        criterion=nn.CrossEntropyLoss(),
    )
    for xb, yb in loader:
        with autocast("cpu", "bf16"):
            out = private(xb)
        F.cross_entropy(out.float(), yb).backward()
        opt.step()
        break
    after = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    n = len(x)
    triples = zip(before, want, after, strict=True)
    noise = torch.cat([((b - lr * s / n - a.detach()) * n / lr).flatten() for b, s, a in triples])
    assert noise.dtype == torch.float32 and noise.numel() > 1000
    on_bf16_grid = float((noise.to(torch.bfloat16).float() == noise).float().mean())
    assert on_bf16_grid < 0.01, on_bf16_grid
    # The reference is float32 and the step bf16: the clipped sum's error (≤ 3e-2 of ‖Σclip‖ ≤ B·C)
    # is far below the noise (σC per coordinate), so the recovered noise is σC within sampling error.
    assert abs(float(noise.std()) / (sigma * c) - 1) < 0.1


def test_unknown_precision_refused() -> None:
    with pytest.raises(ConfigError, match="precision"):
        autocast("cpu", "fp8")


def test_veil_train_precision_bf16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--dataset", "digits", "--model", "mlp", "--precision", "bf16", "--epochs", "1"]
    args += ["--no-baseline", "--reproducible", "--json", "--out", str(tmp_path / "run")]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert all(c["passed"] for c in report["checks"] if c["name"] != "secure_randomness")
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert 'precision = "bf16"' in (tmp_path / "run" / "config.toml").read_text()
    args = ["train", "--dataset", "digits", "--precision", "fp8", "--out", str(tmp_path / "bad")]
    assert main(args) == 2
    assert not (tmp_path / "bad").exists()
