"""Property tests: clipped sums equal a naive per-example loop over random layer configurations.

Shapes, strides, padding (all modes), dilation, groups, sequence lengths, vocabularies, batch
sizes (including 1), loss reductions and clip bounds are drawn by hypothesis; the bound is set
relative to the true per-example norms so that all-clipped, none-clipped and mixed batches all
occur. float64, 1e-9 relative. The reference shares no code with veil.clipping.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from veil.clipping import PerSampleClipper

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLIPS = st.sampled_from(["all", "none", "mixed"])
REDUCTIONS = st.sampled_from(["mean", "sum"])


@pytest.fixture(autouse=True)
def _float64() -> object:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _loss_terms(out: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (out - target).square().flatten(1).sum(1)


def assert_exact(model: nn.Module, x: Tensor, clip: str, reduction: str, seed: int) -> None:
    """veil's clipped sum and norms equal the per-example loop's, for the drawn clip regime."""
    torch.manual_seed(seed)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = copy.deepcopy(model)
    params = [p for p in ref.parameters() if p.requires_grad]
    grads, norms = [], []
    for i in range(x.shape[0]):
        ref.zero_grad(set_to_none=True)
        _loss_terms(ref(x[i : i + 1]), target[i : i + 1]).sum().backward()
        gs = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        grads.append(gs)
        norms.append(math.sqrt(sum(float(g.square().sum()) for g in gs)))
    ordered = sorted(norms)
    if clip == "all":
        bound = ordered[0] / 2 if ordered[0] > 0 else 1e-6
    elif clip == "none":
        bound = ordered[-1] * 2 + 1e-6
    else:
        assume(len(ordered) > 1 and ordered[0] < ordered[-1])
        bound = (ordered[0] + ordered[-1]) / 2
    want = [torch.zeros_like(p) for p in params]
    magnitude = 0.0  # largest Σ_i |clip(g_i)| coordinate: the scale rounding errors of the sum live at
    for gs, n in zip(grads, norms, strict=True):
        for w, g in zip(want, gs, strict=True):
            w += min(1.0, bound / (n + 1e-12)) * g
    for k in range(len(params)):
        summed = sum(min(1.0, bound / (n + 1e-12)) * gs[k].abs() for gs, n in zip(grads, norms, strict=True))
        magnitude = max(magnitude, float(torch.as_tensor(summed).max()))
    clipped = sum(n > bound for n in norms)
    assert {"all": clipped == len(norms) or max(norms) == 0, "none": clipped == 0}.get(
        clip, 0 < clipped < len(norms)
    )

    clipper = PerSampleClipper(model, bound, loss_reduction=reduction)  # type: ignore[arg-type]
    try:
        terms = _loss_terms(model(x), target)
        (terms.mean() if reduction == "mean" else terms.sum()).backward()
        got_norms = clipper.accumulate()
        got = clipper.clipped_sum()
    finally:
        clipper.remove()
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= 1e-9 * max(magnitude, 1e-300)
    assert torch.allclose(got_norms, torch.tensor(norms), rtol=1e-9, atol=1e-300)


@st.composite
def conv_configs(draw: st.DrawFn, dims: int, wide: bool = False) -> tuple[nn.Module, Tensor]:
    groups = 1 if wide else draw(st.integers(1, 3))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    if wide:  # more output channels than patch rows: the rule's patch matmul (unless ghost is cheaper)
        c_out = c_in * math.prod(kernel) + draw(st.integers(1, 3))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding_kind = draw(st.sampled_from(["int", "same", "valid"]))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims)) if padding_kind != "same" else 1
    padding: object = (
        padding_kind if padding_kind != "int" else tuple(draw(st.integers(0, 2)) for _ in range(dims))
    )
    size = tuple(draw(st.integers(1, 7)) for _ in range(dims))
    pads = (
        [0] * dims
        if padding_kind == "valid"
        else [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        if padding_kind == "same"
        else [2 * p for p in padding]  # type: ignore[attr-defined]
    )
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation, strict=True)]
    assume(all(n + p >= s for n, p, s in zip(size, pads, span, strict=True)))
    if mode in ("reflect", "circular"):
        assume(all(p // 2 + p % 2 < n for n, p in zip(size, pads, strict=True)))
    conv_type: Any = nn.Conv1d if dims == 1 else nn.Conv2d
    module = conv_type(
        c_in,
        c_out,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=mode,
    )
    batch = draw(st.integers(1, 4))
    return module, torch.randn(batch, c_in, *size) * draw(st.sampled_from([0.1, 1.0, 10.0]))


@SETTINGS
@given(config=conv_configs(1), clip=CLIPS, reduction=REDUCTIONS, seed=st.integers(0, 2**16))
def test_conv1d(config: tuple[nn.Module, Tensor], clip: str, reduction: str, seed: int) -> None:
    assert_exact(*config, clip, reduction, seed)


@SETTINGS
@given(config=conv_configs(2), clip=CLIPS, reduction=REDUCTIONS, seed=st.integers(0, 2**16))
def test_conv2d(config: tuple[nn.Module, Tensor], clip: str, reduction: str, seed: int) -> None:
    assert_exact(*config, clip, reduction, seed)


@SETTINGS
@given(
    config=st.one_of(conv_configs(1, wide=True), conv_configs(2, wide=True)),
    clip=CLIPS,
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_conv_wide(config: tuple[nn.Module, Tensor], clip: str, reduction: str, seed: int) -> None:
    assert_exact(*config, clip, reduction, seed)


@SETTINGS
@given(
    batch=st.integers(1, 4),
    positions=st.lists(st.integers(1, 5), max_size=2),
    d=st.integers(1, 12),
    p=st.integers(1, 12),
    bias=st.booleans(),
    clip=CLIPS,
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_linear(
    batch: int, positions: list[int], d: int, p: int, bias: bool, clip: str, reduction: str, seed: int
) -> None:
    torch.manual_seed(seed)
    assert_exact(nn.Linear(d, p, bias=bias), torch.randn(batch, *positions, d), clip, reduction, seed)


class _Lookup(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx: int | None, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.out = nn.Linear(dim, vocab)
        if tied:
            self.out.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


@SETTINGS
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 6),
    vocab=st.integers(2, 6),
    dim=st.integers(1, 4),
    padding=st.booleans(),
    tied=st.booleans(),
    clip=CLIPS,
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_embedding(
    batch: int,
    length: int,
    vocab: int,
    dim: int,
    padding: bool,
    tied: bool,
    clip: str,
    reduction: str,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    model = _Lookup(vocab, dim, 0 if padding else None, tied)
    assert_exact(model, torch.randint(0, vocab, (batch, length)), clip, reduction, seed)


@SETTINGS
@given(
    kind=st.sampled_from(["layer", "rms", "group", "instance1d", "instance2d"]),
    batch=st.integers(1, 4),
    channels=st.integers(1, 4),
    spatial=st.integers(2, 5),
    clip=CLIPS,
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**16),
)
def test_norms(
    kind: str, batch: int, channels: int, spatial: int, clip: str, reduction: str, seed: int
) -> None:
    torch.manual_seed(seed)
    if kind == "layer":
        module: nn.Module = nn.LayerNorm(channels)
        x = torch.randn(batch, spatial, channels)
    elif kind == "rms":
        module, x = nn.RMSNorm(channels), torch.randn(batch, spatial, channels)
    elif kind == "group":
        module, x = nn.GroupNorm(1, channels), torch.randn(batch, channels, spatial)
    elif kind == "instance1d":
        module, x = nn.InstanceNorm1d(channels, affine=True), torch.randn(batch, channels, spatial)
    else:
        module, x = nn.InstanceNorm2d(channels, affine=True), torch.randn(batch, channels, spatial, 2)
    with torch.no_grad():  # non-trivial affine parameters
        for p in module.parameters():
            p.normal_()
    assert_exact(module, x * 3 + 1, clip, reduction, seed)


@SETTINGS
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 5),
    heads=st.sampled_from([1, 2]),
    batch_first=st.booleans(),
    clip=CLIPS,
    seed=st.integers(0, 2**16),
)
def test_attention(batch: int, length: int, heads: int, batch_first: bool, clip: str, seed: int) -> None:
    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, heads, batch_first=batch_first)

        def forward(self, x: Tensor) -> Tensor:
            q = x if batch_first else x.transpose(0, 1)
            out = self.attn(q, q, q)[0]
            return out if batch_first else out.transpose(0, 1)

    torch.manual_seed(seed)
    assert_exact(SelfAttention(), torch.randn(batch, length, 4), clip, "mean", seed)
