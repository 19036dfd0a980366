"""Exactness of per-sample clipping against a naive per-example loop (float64, 1e-9 relative).

The reference runs each example alone (a batch of one), backpropagates that example's own loss
term through an unhooked copy of the model, clips the full gradient to C by its norm (or each
group's part to C_k), and sums. Nothing in it shares code with veil.clipping.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import veil.clipping.fallback as fallback_module
import veil.clipping.rules.conv as conv_rule
from veil.clipping import LayerRule, PerSampleClipper, register_rule, supports
from veil.clipping._linear_algebra import ghost_is_cheaper
from veil.errors import InvalidParameterError, ModelNotSupportedError
from veil.models.scattering import ScatteringHead

RTOL = 1e-9


@pytest.fixture(autouse=True)
def _float64() -> object:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    yield
    torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------- reference
def _output(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _terms(out: Tensor, target: Tensor) -> Tensor:
    """Per-example loss terms: 0.5·‖out_i − target_i‖², shape [B]."""
    return 0.5 * (out - target).square().flatten(1).sum(1)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def per_example_grads(model: nn.Module, x: Tensor, target: Tensor) -> list[list[Tensor]]:
    """Each example's own gradient (batch of one, unhooked copy), for every trainable parameter."""
    ref = copy.deepcopy(model)
    params = [p for _, p in _trainable(ref)]
    grads = []
    for i in range(x.shape[0]):
        ref.zero_grad(set_to_none=True)
        _terms(_output(ref(x[i : i + 1])), target[i : i + 1]).sum().backward()
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    return grads


def clip_and_sum(
    grads: list[list[Tensor]], bounds: Sequence[float], group_of: Sequence[int] | None = None
) -> tuple[list[Tensor], Tensor]:
    """Σ_i clip(g_i): flat when ``group_of`` is None, else per group with bound ``bounds[k]``."""
    total = [torch.zeros_like(g) for g in grads[0]] if grads else []
    norms = []
    for gs in grads:
        flat = math.sqrt(sum(float(g.square().sum()) for g in gs))
        norms.append(flat)
        if group_of is None:
            factors = [min(1.0, bounds[0] / (flat + 1e-12))] * len(gs)
        else:
            sq: dict[int, float] = {}
            for g, k in zip(gs, group_of, strict=True):
                sq[k] = sq.get(k, 0.0) + float(g.square().sum())
            factors = [min(1.0, bounds[k] / (math.sqrt(sq[k]) + 1e-12)) for k in group_of]
        for t, g, f in zip(total, gs, factors, strict=True):
            t += f * g
    return total, torch.tensor(norms)


def run_clipper(
    model: nn.Module,
    x: Tensor,
    target: Tensor,
    bound: float | Sequence[float],
    reduction: str = "mean",
    clipping: str = "flat",
) -> tuple[PerSampleClipper, list[Tensor], Tensor]:
    clipper = PerSampleClipper(model, bound, clipping=clipping, loss_reduction=reduction)  # type: ignore[arg-type]
    try:
        terms = _terms(_output(model(x)), target)
        (terms.mean() if reduction == "mean" else terms.sum()).backward()
        norms = clipper.accumulate()
        return clipper, clipper.clipped_sum(), norms
    finally:
        clipper.remove()


def assert_close(got: Sequence[Tensor], want: Sequence[Tensor]) -> None:
    assert len(got) == len(want)
    scale = max((float(w.abs().max()) for w in want if w.numel()), default=0.0)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        err = float((g - w).abs().max()) if g.numel() else 0.0
        assert err <= RTOL * max(scale, 1e-300), (err, scale)


def check_exact(
    model: nn.Module,
    x: Tensor,
    *,
    reduction: str = "mean",
    clip: str = "mixed",
) -> list[list[Tensor]]:
    """Clipped sum and norms equal the naive loop; returns the per-example grads."""
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    grads = per_example_grads(model, x, target)
    _, norms = clip_and_sum(grads, [1.0])
    median = float(norms.median()) if len(norms) else 1.0
    bound = {"mixed": median, "all": median * 1e-3 + 1e-30, "none": float(norms.max()) * 10 + 1}[clip]
    want, want_norms = clip_and_sum(grads, [bound])
    if clip == "mixed" and len(norms) > 1:
        assert (norms > bound).any() and (norms <= bound).any()
    clipper, got, got_norms = run_clipper(model, x, target, bound, reduction)
    assert [id(p) for p in clipper.parameters] == [id(p) for _, p in _trainable(model)]
    assert_close(got, want)
    assert torch.allclose(got_norms, want_norms, rtol=RTOL, atol=0)
    for p in model.parameters():
        assert p.grad is None
    return grads


# ---------------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, stride=1, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, groups=2, dilation=1)
        self.fc = nn.Linear(6 * 3 * 3, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.norm(self.conv1(x)))
        x = F.max_pool2d(x, 1)
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class SequenceModel(nn.Module):
    """Embedding + Conv1d + LayerNorm + sequence Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.conv(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.norm(h)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 5)
        self.mix = nn.Linear(5, 5)
        self.out = nn.Linear(5, 9, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class Scaled(nn.Module):
    """A custom layer owning a parameter directly (torch.func fallback), around a child Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(torch.sin(x * self.scale)) * self.scale


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


MODELS: dict[str, Callable[[], tuple[nn.Module, Tensor]]] = {
    "linear": lambda: (nn.Linear(5, 3), torch.randn(6, 5)),
    "linear_seq_ghost": lambda: (nn.Linear(20, 16), torch.randn(5, 3, 20)),
    "linear_seq_materialise": lambda: (nn.Linear(3, 2), torch.randn(5, 7, 3)),
    "linear_rank4": lambda: (nn.Linear(4, 3), torch.randn(5, 2, 3, 4)),
    "linear_no_bias": lambda: (nn.Linear(4, 3, bias=False), torch.randn(5, 4)),
    "conv1d": lambda: (nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), torch.randn(5, 4, 13)),
    "conv1d_same_reflect": lambda: (
        nn.Conv1d(3, 3, 4, padding="same", padding_mode="reflect"),
        torch.randn(4, 3, 9),
    ),
    "conv2d": lambda: (nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0)), torch.randn(5, 3, 7, 6)),
    "conv2d_groups_circular": lambda: (
        nn.Conv2d(4, 8, 3, padding=1, groups=4, padding_mode="circular", bias=False),
        torch.randn(4, 4, 5, 5),
    ),
    "conv2d_same_even": lambda: (nn.Conv2d(2, 3, 2, padding="same", dilation=1), torch.randn(4, 2, 5, 5)),
    "conv2d_ghost": lambda: (nn.Conv2d(8, 16, 3), torch.randn(4, 8, 4, 4)),
    # patches no larger than the output gradient: weight and bias from one matmul over the patches
    "conv2d_patches": lambda: (
        nn.Conv2d(2, 20, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        torch.randn(5, 2, 7, 8),
    ),
    "conv2d_patches_reflect_no_bias": lambda: (
        nn.Conv2d(1, 9, 3, padding="same", padding_mode="reflect", bias=False),
        torch.randn(4, 1, 6, 5),
    ),
    "conv2d_patches_same_even": lambda: (nn.Conv2d(1, 5, 2, padding="same"), torch.randn(4, 1, 5, 6)),
    "conv2d_patches_channels_last": lambda: (
        nn.Conv2d(2, 24, 3),  # unpadded: the patches are read from the input's own strides
        torch.randn(4, 2, 6, 7).contiguous(memory_format=torch.channels_last),
    ),
    "conv1d_patches_strided_input": lambda: (
        nn.Conv1d(2, 8, 3, stride=2),  # unpadded: the patches are read from the view itself
        torch.randn(5, 4, 11)[:, 1::2],  # a non-contiguous view at an offset
    ),
    "embedding": lambda: (nn.Embedding(5, 3), torch.randint(0, 5, (6, 7))),
    "embedding_padding_idx": lambda: (nn.Embedding(5, 3, padding_idx=1), torch.randint(0, 5, (6, 7))),
    "embedding_max_norm": lambda: (nn.Embedding(5, 3, max_norm=1.0), torch.randint(0, 5, (6, 4))),
    "layernorm": lambda: (nn.LayerNorm(4), torch.randn(5, 3, 4) * 2 + 1),
    "layernorm_2d_shape_no_bias": lambda: (nn.LayerNorm((3, 4), bias=False), torch.randn(5, 3, 4)),
    "groupnorm": lambda: (nn.GroupNorm(2, 4), torch.randn(5, 4, 3, 3)),
    "instancenorm1d": lambda: (nn.InstanceNorm1d(3, affine=True), torch.randn(5, 3, 6)),
    "instancenorm2d": lambda: (nn.InstanceNorm2d(3, affine=True), torch.randn(5, 3, 4, 4)),
    "rmsnorm": lambda: (nn.RMSNorm(4), torch.randn(5, 3, 4)),
    "rmsnorm_eps": lambda: (nn.RMSNorm([2, 4], eps=1e-3), torch.randn(5, 2, 4)),
    "cnn_groupnorm": lambda: (SmallCNN(), torch.randn(5, 1, 8, 8)),
    # The scatternet preset's head: two scales cut out of one row, each group-normalised, one linear.
    "scattering_head": lambda: (
        ScatteringHead([(6, 3, 3), (3, 4, 4)], 3),
        torch.randn(5, 6 * 9 + 3 * 16) * 3,
    ),
    "mlp": lambda: (mlp(), torch.randn(7, 6)),
    "embedding_conv1d_layernorm_linear": lambda: (SequenceModel(), torch.randint(0, 11, (5, 8))),
    "transformer_encoder_layer": lambda: (
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        torch.randn(4, 5, 8),
    ),
    "transformer_norm_first_gelu": lambda: (
        nn.TransformerEncoderLayer(
            8, 4, 12, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        ),
        torch.randn(3, 6, 8),
    ),
    "custom_fallback": lambda: (Scaled(), torch.randn(5, 4)),
    "tied_weights": lambda: (TiedLM(), torch.randint(0, 9, (5, 6))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_naive_loop(name: str, reduction: str) -> None:
    model, x = MODELS[name]()
    check_exact(model, x, reduction=reduction)


@pytest.mark.parametrize("clip", ["all", "none"])
@pytest.mark.parametrize("name", ["cnn_groupnorm", "transformer_encoder_layer", "tied_weights"])
def test_all_and_none_clipped(name: str, clip: str) -> None:
    model, x = MODELS[name]()
    check_exact(model, x, clip=clip)


@pytest.mark.parametrize(
    "name", ["cnn_groupnorm", "conv2d_patches", "transformer_encoder_layer", "tied_weights"]
)
def test_float32_model_is_close_to_float64_reference(name: str) -> None:
    model, x = MODELS[name]()
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    grads = per_example_grads(model, x, target)
    _, norms = clip_and_sum(grads, [1.0])
    want, _ = clip_and_sum(grads, [float(norms.median())])
    model32 = copy.deepcopy(model).float()
    x32 = x.float() if x.is_floating_point() else x
    _, got, _ = run_clipper(model32, x32, target.float(), float(norms.median()))
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        assert float((g.double() - w).abs().max()) <= 1e-4 * scale


@pytest.mark.parametrize(
    "name",
    [
        "cnn_groupnorm",
        "conv2d_patches",
        "transformer_encoder_layer",
        "tied_weights",
        "custom_fallback",
    ],
)
def test_bfloat16_autocast_is_close_to_float64_reference(name: str) -> None:
    model, x = MODELS[name]()
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    grads = per_example_grads(model, x, target)
    _, norms = clip_and_sum(grads, [1.0])
    bound = float(norms.median())
    want, _ = clip_and_sum(grads, [bound])
    model32 = copy.deepcopy(model).float()
    clipper = PerSampleClipper(model32, bound)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _output(model32(x.float() if x.is_floating_point() else x))
    _terms(out.float(), target.float()).mean().backward()
    clipper.accumulate()
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(clipper.clipped_sum(), want, strict=True):
        assert g.dtype == torch.float32
        assert float((g.double() - w).abs().max()) <= 3e-2 * scale  # bf16 keeps ~3 significant digits
    clipper.remove()


def test_both_linear_forms_are_exercised() -> None:
    assert ghost_is_cheaper(3, 20, 16) and not ghost_is_cheaper(7, 3, 2)
    assert ghost_is_cheaper(4, 8 * 9, 16) and not ghost_is_cheaper(5 * 5, 1 * 9, 2)


@pytest.mark.parametrize(
    ("name", "patches"),
    [
        ("conv2d_patches", True),
        ("conv2d_patches_reflect_no_bias", True),
        ("conv2d_patches_same_even", True),
        ("conv2d_patches_channels_last", True),
        ("conv1d_patches_strided_input", True),
        ("conv2d", False),
        ("conv1d_same_reflect", False),
        ("conv2d_same_even", False),
    ],
)
def test_both_materialised_conv_forms_are_exercised(
    name: str, patches: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MODELS above reach the path their name says: the patch matmul or the grouped convolution."""
    used: list[str] = []
    for fn in ("per_sample_weight", "per_sample_weight_and_bias"):
        original = getattr(conv_rule, fn)

        def spy(*args: object, _fn: str = fn, _original: Callable[..., object] = original) -> object:
            used.append(_fn)
            return _original(*args)

        monkeypatch.setattr(conv_rule, fn, spy)
    check_exact(*MODELS[name]())
    assert used == ["per_sample_weight_and_bias" if patches else "per_sample_weight"]


class SharedInputProjections(nn.Module):
    """Query/key/value-like Linears on one input, another Linear of the same shape on a different
    input, and one on a view of the first input (another tensor object: it does not share)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.other, self.after = (nn.Linear(20, 16) for _ in range(5))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x)
        mixed = self.q(h) * self.k(h) + self.v(h) + self.other(torch.sin(x))
        return mixed * self.after(h.view(h.shape))


def test_linears_on_one_input_share_its_gram_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ghost norms of Linears that read the same tensor compute its Gram matrix once (the query, key
    and value projections of a transformer), and the clipped sum still equals the naive loop."""
    import veil.clipping._linear_algebra as linear_algebra

    model, x = SharedInputProjections(), torch.randn(5, 3, 20)
    assert ghost_is_cheaper(3, 20, 16)
    products: list[tuple[int, ...]] = []
    bmm = torch.bmm

    def counting(a: Tensor, b: Tensor) -> Tensor:
        products.append(tuple(a.shape))
        return bmm(a, b)

    monkeypatch.setattr(linear_algebra.torch, "bmm", counting)
    check_exact(model, x)
    monkeypatch.undo()
    # Input Grams [B, T, 20]: h once for q, k and v; sin(x); the view of h. Output Grams: one a call.
    assert len([s for s in products if s[-1] == 16]) == 5
    assert len([s for s in products if s[-1] == 20]) == 3


def test_an_inference_tensor_input_is_clipped_without_sharing() -> None:
    """An input made under ``torch.inference_mode`` has no version counter: it shares no Gram matrix
    and is clipped as the same values made normally are."""
    model = nn.Linear(20, 16)
    with torch.inference_mode():
        frozen = torch.randn(5, 3, 20)
    x = frozen.clone()
    target = torch.randn(5, 3, 16)
    _, want, want_norms = run_clipper(model, x, target, 1.0)
    _, got, got_norms = run_clipper(model, frozen, target, 1.0)
    assert_close(got, want)
    assert torch.equal(got_norms, want_norms)


# ---------------------------------------------------------------------------- attention
class Attention(nn.Module):
    def __init__(self, mode: str, **kwargs: object) -> None:
        super().__init__()
        self.mode = mode
        kdim = 6 if mode == "kdim" else None
        self.attn = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, **kwargs)
        self.first = kwargs.get("batch_first", False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        q = x if self.first else x.transpose(0, 1)
        mem = torch.tanh(q * 1.5)
        if self.mode == "self":
            out = self.attn(q, q, q, need_weights=False)[0]
        elif self.mode == "weights":
            out, w = self.attn(q, q, q, need_weights=True, average_attn_weights=False)
            out = out + w.sum() * 0  # weights reach the loss below too
            out = out * (1 + w.mean(dim=(1, 2, 3)).view(-1, 1, 1) if self.first else 1)
        elif self.mode == "cross":
            out = self.attn(q, mem, mem)[0]
        elif self.mode == "kdim":
            mem6 = mem[..., :6]
            out = self.attn(q, mem6, mem6 * 2)[0]
        elif self.mode == "masks":
            length = 3 + (x[:, 0, 0] > 0).long()  # per-example padding decided by the data
            pad = torch.arange(t).unsqueeze(0) >= length.unsqueeze(1)
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            out = self.attn(q, q, q, key_padding_mask=pad, attn_mask=causal)[0]
        else:
            raise AssertionError(self.mode)
        return out if self.first else out.transpose(0, 1)


@pytest.mark.parametrize(
    ("mode", "kwargs"),
    [
        ("self", {"batch_first": True}),
        ("self", {"batch_first": False, "bias": False}),
        ("weights", {"batch_first": True}),
        ("cross", {"batch_first": True}),
        ("kdim", {"batch_first": True}),
        ("masks", {"batch_first": True}),
        ("self", {"batch_first": True, "add_zero_attn": True}),
    ],
)
def test_attention_captures_projections_exactly(
    mode: str, kwargs: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fallback(*args: object, **kw: object) -> None:
        raise AssertionError("MultiheadAttention must not need the torch.func fallback")

    monkeypatch.setattr(fallback_module.FunctionalRule, "contributions", no_fallback)
    check_exact(Attention(mode, **kwargs), torch.randn(4, 5, 8))


@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_bias_kv_uses_exact_fallback(batch_first: bool) -> None:
    check_exact(Attention("self", batch_first=batch_first, add_bias_kv=True), torch.randn(4, 5, 8))


# ---------------------------------------------------------------------------- per-layer clipping
def _groups(model: nn.Module) -> tuple[list[str], list[int]]:
    """Reference grouping: one group per module owning parameters directly (attention whole)."""
    names: list[str] = []
    group_of: dict[int, int] = {}
    inside: set[int] = set()
    for name, mod in model.named_modules():
        if id(mod) in inside:
            continue
        params = mod.named_parameters(recurse=isinstance(mod, nn.MultiheadAttention))
        if isinstance(mod, nn.MultiheadAttention):
            inside.update(id(m) for m in mod.modules() if m is not mod)
        new = [p for _, p in params if p.requires_grad and id(p) not in group_of]
        if new:
            names.append(name or "(root module)")
            for p in new:
                group_of[id(p)] = len(names) - 1
    return names, [group_of[id(p)] for _, p in _trainable(model)]


@pytest.mark.parametrize(
    "name", ["cnn_groupnorm", "transformer_encoder_layer", "tied_weights", "custom_fallback"]
)
@pytest.mark.parametrize("split", [False, True])
def test_per_layer_matches_naive_loop(name: str, split: bool) -> None:
    model, x = MODELS[name]()
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    grads = per_example_grads(model, x, target)
    group_names, group_of = _groups(model)
    per_group = [
        math.sqrt(sum(float(g.square().sum()) for g, k in zip(gs, group_of, strict=True) if k == j))
        for gs in grads
        for j in range(len(group_names))
    ]
    median = sorted(per_group)[len(per_group) // 2]
    if split:
        bound: float | list[float] = median * math.sqrt(len(group_names))
        bounds = [median] * len(group_names)
    else:
        bounds = [median * (0.5 + j / len(group_names)) for j in range(len(group_names))]
        bound = bounds
    want, _ = clip_and_sum(grads, bounds, group_of)
    clipper, got, _ = run_clipper(model, x, target, bound, clipping="per_layer")
    assert clipper.groups == group_names
    assert_close(got, want)
    assert clipper.sensitivity == pytest.approx(math.sqrt(sum(c * c for c in bounds)), rel=1e-12)


# ---------------------------------------------------------------------------- batch sizes, accumulation
@pytest.mark.parametrize(
    "name",
    [
        "cnn_groupnorm",
        "conv2d_patches",
        "embedding_conv1d_layernorm_linear",
        "transformer_encoder_layer",
    ],
)
def test_batch_of_one(name: str) -> None:
    model, x = MODELS[name]()
    check_exact(model, x[:1], clip="all")
    check_exact(model, x[:1], clip="none", reduction="sum")


@pytest.mark.parametrize(
    "name",
    [
        "cnn_groupnorm",
        "conv2d_patches",
        "tied_weights",
        "custom_fallback",
        "transformer_encoder_layer",
    ],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empty_batch_accumulates_nothing(name: str, reduction: str) -> None:
    model, x = MODELS[name]()
    clipper = PerSampleClipper(model, 1.0, loss_reduction=reduction)  # type: ignore[arg-type]
    terms = _terms(_output(model(x[:0])), torch.zeros_like(_output(model(x[:0]))))
    (terms.mean() if reduction == "mean" else terms.sum()).backward()
    norms = clipper.accumulate()
    assert norms.shape == (0,)
    for total, p in zip(clipper.clipped_sum(), clipper.parameters, strict=True):
        assert total.shape == p.shape and not total.any()
    clipper.remove()


def test_accumulates_over_physical_batches_and_resets() -> None:
    model, x = MODELS["cnn_groupnorm"]()
    with torch.no_grad():
        target = torch.randn_like(model(x))
    grads = per_example_grads(model, x, target)
    want, _ = clip_and_sum(grads, [0.3])
    clipper = PerSampleClipper(model, 0.3)
    for part in (slice(0, 2), slice(2, 2), slice(2, 5)):
        _terms(model(x[part]), target[part]).mean().backward()
        assert clipper.accumulate().shape == (part.stop - part.start,)
    assert_close(clipper.clipped_sum(), want)
    kept = clipper.clipped_sum()
    clipper.reset()
    assert all(not t.any() for t in clipper.clipped_sum())
    assert_close(kept, want)  # what the engine took stays valid after reset
    clipper.remove()


def test_module_called_twice_gets_summed_gradient() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    check_exact(Twice(), torch.randn(5, 4))


def test_frozen_parameters_are_skipped() -> None:
    model, x = MODELS["cnn_groupnorm"]()
    model.conv1.requires_grad_(False)
    model.fc.bias.requires_grad_(False)  # type: ignore[union-attr]
    check_exact(model, x)
    clipper = PerSampleClipper(model, 1.0)
    assert all(p.requires_grad for p in clipper.parameters)
    assert "conv1" not in clipper.groups
    clipper.remove()


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_freezing_after_creation_is_refused_and_flags_restored(change: str) -> None:
    first, middle = nn.Linear(6, 8), nn.Linear(8, 8)
    model = nn.Sequential(first, nn.Tanh(), middle)
    middle.bias.requires_grad_(False)
    clipper = PerSampleClipper(model, 1.0)
    target = first.weight if change == "freeze" else middle.bias
    target.requires_grad_(change == "unfreeze")
    model(torch.randn(3, 6)).sum().backward()
    assert target.requires_grad == (change == "unfreeze")  # the forward restored the user's choice
    with pytest.raises(ModelNotSupportedError, match="frozen or unfrozen"):
        clipper.accumulate()
    clipper.remove()


def test_first_layer_output_may_be_modified_in_place() -> None:
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    check_exact(model, torch.randn(6, 5))


def test_first_layer_never_alters_the_callers_tensors() -> None:
    class PassThrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x * self.w, x  # the second output is the caller's own tensor

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = PassThrough()

        def forward(self, x: Tensor) -> Tensor:
            y, same = self.inner(x)
            return y + same.sin()

    x = torch.randn(5, 4)
    model = Model()
    check_exact(model, x)
    clipper = PerSampleClipper(model, 1.0)
    model(x).sum().backward()
    assert not x.requires_grad and x.grad_fn is None
    clipper.accumulate()
    clipper.remove()


def test_input_that_requires_grad() -> None:
    model = mlp()
    x = torch.randn(5, 6, requires_grad=True)
    check_exact(model, x)


def test_forward_without_grad_is_not_captured() -> None:
    model, x = MODELS["mlp"]()
    with torch.no_grad():
        target = torch.randn_like(model(x))
    want, _ = clip_and_sum(per_example_grads(model, x, target), [0.5])
    clipper = PerSampleClipper(model, 0.5)
    with torch.no_grad():
        model(torch.randn(3, 6))  # evaluation on another batch size
    _terms(model(x), target).mean().backward()
    clipper.accumulate()
    assert_close(clipper.clipped_sum(), want)
    assert all(p.requires_grad for p in model.parameters())
    clipper.remove()


@pytest.mark.parametrize("name", ["mlp", "custom_fallback"])
def test_two_backward_passes_before_accumulate_are_refused(name: str) -> None:
    model, x = MODELS[name]()
    clipper = PerSampleClipper(model, 1.0)
    model(x[:2]).square().sum().backward()
    model(x[2:4]).square().sum().backward()
    with pytest.raises(ModelNotSupportedError, match="more than one backward"):
        clipper.accumulate()
    out = model(x[:2]).square().sum()
    out.backward(retain_graph=True)
    out.backward()
    with pytest.raises(ModelNotSupportedError, match="more than one backward"):
        clipper.accumulate()
    out = model(x[:2]).square().sum()
    out.backward(retain_graph=True)
    clipper.accumulate()
    out.backward()  # after accumulate(): its gradients have nowhere to go
    with pytest.raises(ModelNotSupportedError, match="more than one backward"):
        clipper.accumulate()
    clipper.remove()


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.first = nn.Linear(6, 6)
        tied = nn.Linear(6, 6)
        tied.weight = self.first.weight  # tied across the checkpoint boundary
        self.inner = nn.Sequential(tied, nn.Tanh(), nn.Linear(6, 3))
        self.last = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.inner, torch.tanh(self.first(x)), use_reentrant=self.reentrant)
        return self.last(h)


def test_non_reentrant_activation_checkpointing_is_exact() -> None:
    check_exact(Checkpointed(reentrant=False), torch.randn(5, 6))


def test_reentrant_activation_checkpointing_is_refused() -> None:
    model = Checkpointed(reentrant=True)
    clipper = PerSampleClipper(model, 1.0)
    model(torch.randn(4, 6)).square().sum().backward()
    with pytest.raises(ModelNotSupportedError, match="checkpointing"):
        clipper.accumulate()
    clipper.remove()


def test_forward_after_backward_without_gradient_is_ignored() -> None:
    model, x = MODELS["mlp"]()
    with torch.no_grad():
        target = torch.randn_like(model(x))
    want, _ = clip_and_sum(per_example_grads(model, x, target), [0.5])
    clipper = PerSampleClipper(model, 0.5)
    _terms(model(x), target).mean().backward()
    model(torch.randn(3, 6))  # e.g. a metric computed with grad enabled before the step
    clipper.accumulate()
    assert_close(clipper.clipped_sum(), want)
    clipper.remove()


# ---------------------------------------------------------------------------- registry
class PlainSubLinear(nn.Linear):
    """A subclass that keeps Linear's forward: it must use the Linear rule."""


class RewrittenLinear(nn.Linear):
    """A subclass with its own math: it must not inherit the Linear rule."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x * x, self.weight, self.bias)


def test_subclass_uses_parent_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(*args: object, **kw: object) -> None:
        raise AssertionError("the Linear rule should have been used")

    monkeypatch.setattr(fallback_module.FunctionalRule, "contributions", no_fallback)
    check_exact(PlainSubLinear(4, 3), torch.randn(5, 4))


def test_subclass_overriding_forward_uses_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = fallback_module.FunctionalRule.contributions

    def spy(self: object, *args: object, **kw: object) -> object:
        calls.append(1)
        return original(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fallback_module.FunctionalRule, "contributions", spy)
    check_exact(RewrittenLinear(4, 3), torch.randn(5, 4))
    assert calls


def test_register_rule_for_new_type() -> None:
    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.gain

    used = []

    @register_rule(Gain)
    class GainRule(LayerRule):
        param_names = ("gain",)

        def contributions(self, module, record, names, materialise):  # type: ignore[no-untyped-def]
            from veil.clipping import Materialised

            used.append(1)
            return {"gain": Materialised(record.args[0] * record.grads[0])}

    model = nn.Sequential(nn.Linear(3, 3), Gain(), nn.Linear(3, 2))
    check_exact(model, torch.randn(5, 3))
    assert used and supports(Gain())


def test_supports() -> None:
    assert supports(nn.Linear(2, 2)) and supports(nn.Conv2d(1, 1, 1)) and supports(Scaled())
    assert supports(nn.MultiheadAttention(4, 2))
    assert not supports(nn.BatchNorm1d(3))
    assert not supports(nn.Embedding(3, 2, scale_grad_by_freq=True))
    with pytest.raises(TypeError):
        register_rule(int)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- refusals
def test_batchnorm_is_refused_with_every_problem_listed() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Embedding(3, 3, scale_grad_by_freq=True))
    with pytest.raises(ModelNotSupportedError) as info:
        PerSampleClipper(model, 1.0)
    assert len(info.value.problems) == 2
    assert "Fix:" in str(info.value)


def test_parameter_used_outside_its_module_is_refused() -> None:
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) + x @ self.lin.weight.T

    model = Leaky()
    clipper = PerSampleClipper(model, 1.0)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ModelNotSupportedError, match=r"lin\.weight"):
        clipper.accumulate()
    clipper.remove()


def test_batch_dimension_change_is_refused() -> None:
    class Folding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x).reshape(-1, 3))

    model = Folding()
    clipper = PerSampleClipper(model, 1.0)
    model(torch.randn(4, 2, 3)).sum().backward()
    with pytest.raises(ModelNotSupportedError, match="dimension 0"):
        clipper.accumulate()
    clipper.remove()


@pytest.mark.parametrize("kind", ["dropout", "batch_mean"])
def test_fallback_refuses_inexact_modules(kind: str) -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x: Tensor) -> Tensor:
            if kind == "dropout":
                return F.dropout(x * self.w, 0.5, training=True)
            return (x - x.mean(dim=0)) * self.w

    model = Odd()
    clipper = PerSampleClipper(model, 1.0)
    model(torch.randn(4, 3)).square().sum().backward()
    with pytest.raises(ModelNotSupportedError, match="Fix:"):
        clipper.accumulate()
    clipper.remove()


@pytest.mark.parametrize("bound", [0.0, -1.0, math.inf, math.nan, True])
def test_invalid_bound_is_refused(bound: float) -> None:
    with pytest.raises(InvalidParameterError, match="max_grad_norm"):
        PerSampleClipper(nn.Linear(2, 2), bound)


def test_invalid_per_layer_bounds_and_modes() -> None:
    model = mlp()
    with pytest.raises(InvalidParameterError):
        PerSampleClipper(model, [1.0, 1.0], clipping="per_layer")  # 3 groups
    with pytest.raises(InvalidParameterError):
        PerSampleClipper(model, [1.0, 1.0, 1.0])  # a list needs per_layer
    with pytest.raises(InvalidParameterError):
        PerSampleClipper(model, 1.0, clipping="global")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        PerSampleClipper(model, 1.0, loss_reduction="none")  # type: ignore[arg-type]


def test_one_clipper_per_module() -> None:
    model = mlp()
    first = PerSampleClipper(model, 1.0)
    with pytest.raises(InvalidParameterError, match="another PerSampleClipper"):
        PerSampleClipper(model, 1.0)
    first.remove()
    PerSampleClipper(model, 1.0).remove()


def test_sensitivity() -> None:
    model = mlp()
    flat = PerSampleClipper(model, 2.5)
    assert flat.sensitivity == 2.5
    flat.remove()
    split = PerSampleClipper(model, 3.0, clipping="per_layer")
    assert split.groups == ["0", "2", "4"]
    assert split.max_grad_norms == pytest.approx([3.0 / math.sqrt(3)] * 3)
    assert split.sensitivity == pytest.approx(3.0, rel=1e-12)
    split.remove()
    listed = PerSampleClipper(model, [1.0, 2.0, 2.0], clipping="per_layer")
    assert listed.sensitivity == pytest.approx(3.0, rel=1e-12)
    listed.remove()
