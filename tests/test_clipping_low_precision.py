"""Low precision: each clipped per-example contribution has norm ≤ C *in the parameter dtype*.

The clipper computes norms and clip factors in float32 and applies them to bfloat16/float16
per-example gradients; a factor rounded up on the cast, or a product rounded up coordinate by
coordinate, would let one example move the sum by more than C (unaccounted). Each example is run
alone through the real clipper, so the accumulated sum *is* its contribution, read exactly in
float64 from the parameter dtype. Deterministic (fixed seeds); no false-failure rate to state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from veil.clipping import PerSampleClipper

CLIP = 1.0


def _models(dtype: torch.dtype) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "linear-ghost": nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 5)).to(dtype),
        "sequence": nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 4)).to(dtype),
        "conv": nn.Sequential(nn.Conv1d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 10, 4)).to(dtype),
        # more output channels than patch rows: the conv rule's patch matmul
        "conv-patches": nn.Sequential(nn.Conv1d(2, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 10, 4)).to(
            dtype
        ),
    }


def _inputs(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    shape = {"linear-ghost": (n, 32), "sequence": (n, 7, 6), "conv": (n, 3, 12), "conv-patches": (n, 2, 12)}[
        name
    ]
    return (torch.randn(shape, generator=g) * torch.logspace(-1, 2, n).view(-1, *[1] * (len(shape) - 1))).to(
        dtype
    )


def _contribution_norms(model: nn.Module, x: torch.Tensor, reduction: str) -> list[float]:
    clipper = PerSampleClipper(model, CLIP, loss_reduction=reduction)  # type: ignore[arg-type]
    norms = []
    for i in range(len(x)):
        out = model(x[i : i + 1])
        # a loss whose gradient scale varies with i, so the clip factors take many values
        loss = (out.float() * (1.0 + 0.37 * i)).square().sum()
        loss.backward()
        clipper.accumulate()
        sums = clipper.clipped_sum()
        assert all(s.dtype == torch.float32 for s in sums)  # accumulated at float32
        # ...and still within C once rounded to the parameter dtype (what a bf16 model would hold)
        rounded = [s.to(p.dtype) for s, p in zip(sums, clipper.parameters, strict=True)]
        norms.append(max(sum(float(t.double().square().sum()) for t in ts) ** 0.5 for ts in (sums, rounded)))
        clipper.reset()
    clipper.remove()
    return norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["linear-ghost", "sequence", "conv", "conv-patches"])
def test_each_contribution_stays_within_c_in_the_parameter_dtype(name: str, dtype: torch.dtype) -> None:
    model = _models(dtype)[name]
    x = _inputs(name, 120, dtype)
    norms = _contribution_norms(model, x, "sum")
    clipped = [v for v in norms if v > 0.9 * CLIP]
    assert len(clipped) > 80  # most examples are clipped, so the bound is actually exercised
    assert max(norms) <= CLIP, f"worst contribution {max(norms):.6f} > C = {CLIP}"
    assert max(norms) > 0.98 * CLIP  # the margin costs < 1 % of the step, no more


def test_the_margin_is_what_keeps_contributions_within_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the 1 - 2u margin the same bf16 check fails: the test above can fail."""
    monkeypatch.setattr(PerSampleClipper, "_rounding_margin", lambda self: 1.0)
    model = _models(torch.bfloat16)["linear-ghost"]
    norms = _contribution_norms(model, _inputs("linear-ghost", 160, torch.bfloat16), "sum")
    assert max(norms) > CLIP
