"""Rules for ``nn.Conv1d`` and ``nn.Conv2d`` (stride, padding of any mode, dilation, groups, bias).

A convolution is a grouped linear map applied at every output position to the unfolded input
patch, so the weight's per-sample gradient is ``Σ_l g_l a_lᵀ`` per group over the ``L`` output
positions (see :mod:`veil.clipping._linear_algebra`); ghost or materialised by cost. An ungrouped
convolution's materialised gradients come from one batched matmul over its input patches, the bias
gradient with them, when the patches take no more memory than the output gradient the rule already
holds (:func:`patches_fit`; CPU time 1.4× below the grouped convolution's for the SimpleCNN's 1→32
layer, 1.8× for 4→64 channels, close to the plain summed weight gradient's: ``bench/conv_rule.py``);
otherwise from one grouped convolution (:func:`per_sample_weight`), which holds no patches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from veil.clipping._linear_algebra import common_dtype, ghost_is_cheaper, grouped_linear
from veil.clipping.registry import CallRecord, Contribution, LayerRule, Materialised, register_rule
from veil.clipping.rules._common import batched_input, output_grad

_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _explicit_padding(module: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension, as the module's forward applies it."""
    dims = len(module.kernel_size)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [(0, 0)] * dims
        pads = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(int(p), int(p)) for p in module.padding]


def _padded(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The input as the convolution sees it after padding (any padding mode)."""
    pads = _explicit_padding(module)
    if not any(lo or hi for lo, hi in pads):
        return x
    flat_pad = [v for pair in reversed(pads) for v in pair]
    if module.padding_mode == "zeros":
        return F.pad(x, flat_pad)
    return F.pad(x, flat_pad, mode=module.padding_mode)


def per_sample_weight(module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients ``[B, *weight.shape]`` of an ungrouped convolution.

    ``∂W_b[o, i, u] = Σ_h g[b, o, h] · x_pad[b, i, h·stride + u·dilation]`` is itself a
    convolution of each input channel with the example's output gradient as kernel: run it as
    one grouped convolution with the batch as channels (groups = B), the original stride as
    dilation and the original dilation as stride, then keep the first ``kernel_size`` taps.
    """
    batch, c_in = x.shape[:2]
    c_out = g.shape[1]
    kernel = tuple(module.kernel_size)
    x, g = common_dtype(x, g)
    inputs = _padded(module, x).transpose(0, 1)
    kernels = g.reshape(batch * c_out, 1, *g.shape[2:])
    if len(kernel) == 1:
        taps = F.conv1d(inputs, kernels, stride=module.dilation, dilation=module.stride, groups=batch)
        taps = taps[:, :, : kernel[0]]
    else:
        taps = F.conv2d(inputs, kernels, stride=module.dilation, dilation=module.stride, groups=batch)
        taps = taps[:, :, : kernel[0], : kernel[1]]
    return taps.reshape(c_in, batch, c_out, *kernel).movedim(0, 2)


def patches_fit(rows: int, c_out: int) -> bool:
    """Whether :func:`per_sample_weight_and_bias` is used: its patch matrix ``[B, rows, L]`` (``rows``:
    the weight's ``C_in·prod(kernel)``, plus one for a bias) is no larger than the output gradient
    ``[B, C_out, L]`` already held, so memory stays within what the layer's backward holds anyway."""
    return rows <= c_out


def per_sample_weight_and_bias(
    module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor, bias: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-sample weight gradients ``[B, *weight.shape]`` of an ungrouped convolution, and with ``bias``
    the per-sample bias gradients ``[B, C_out]``, from one batched matmul over the input patches.

    ``∂W_b = Σ_l g[b, :, l] p[b, :, l]ᵀ`` and ``∂bias_b = Σ_l g[b, :, l]``, where ``p[b, :, l]`` is the
    padded input patch that output position ``l`` sees (channel-major, as the weight is laid out). The
    patches are copied once from a strided view of the padded input into ``[B, d (+1), L]``; a row of
    ones appended to them makes the bias gradient the matmul's last row, so the output gradient is read
    once for both.
    """
    x, g = common_dtype(x, g)
    padded = _padded(module, x)
    batch, c_in = padded.shape[:2]
    kernel, out_shape = tuple(module.kernel_size), tuple(g.shape[2:])
    strides = padded.stride()
    spatial = strides[2:]
    window = padded.as_strided(
        (batch, c_in, *kernel, *out_shape),
        (
            strides[0],
            strides[1],
            *(d * s for d, s in zip(module.dilation, spatial, strict=True)),
            *(t * s for t, s in zip(module.stride, spatial, strict=True)),
        ),
    )
    d, positions, c_out = c_in * math.prod(kernel), math.prod(out_shape), g.shape[1]
    patches = padded.new_empty(batch, d + int(bias), positions)
    patches[:, :d].view(batch, c_in, *kernel, *out_shape).copy_(window)
    if bias:
        patches[:, d].fill_(1)
    products = torch.bmm(patches, g.reshape(batch, c_out, positions).transpose(1, 2))  # [B, d (+1), C_out]
    weight = products[:, :d].transpose(1, 2).reshape(batch, *module.weight.shape)
    return weight, (products[:, d] if bias else None)


def unfold_patches(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Input patches ``[B, C_in·prod(kernel), L]`` of a 1-d or 2-d convolution, channel-major."""
    pads = _explicit_padding(module)
    flat_pad = [v for pair in reversed(pads) for v in pair]  # F.pad wants the last dim first
    symmetric = all(lo == hi for lo, hi in pads)
    if module.padding_mode != "zeros":
        x = F.pad(x, flat_pad, mode=module.padding_mode)
        unfold_pad = [0] * len(pads)
    elif symmetric:
        unfold_pad = [lo for lo, _ in pads]
    else:
        x = F.pad(x, flat_pad)
        unfold_pad = [0] * len(pads)
    kernel, dilation, stride = (
        list(module.kernel_size),
        list(module.dilation),
        list(module.stride),
    )
    if x.dim() == 3:  # 1-d: a 2-d convolution with height 1
        x = x.unsqueeze(2)
        kernel, dilation, stride, unfold_pad = (
            [1, *kernel],
            [1, *dilation],
            [1, *stride],
            [0, *unfold_pad],
        )
    return F.unfold(
        x, tuple(kernel), dilation=tuple(dilation), padding=tuple(unfold_pad), stride=tuple(stride)
    )


class _ConvRule(LayerRule):
    eager = True
    groups_rows = True  # an example's K copies: K·L positions of the same patch map
    param_names = ("weight", "bias")
    spatial_dims: ClassVar[int] = 2

    def problem(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.modules.conv._ConvNd)
        if module.padding_mode not in _PADDING_MODES:
            return f"padding_mode={module.padding_mode!r} is not one the convolution rule knows"
        return None

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        x = batched_input(args, kwargs, self.spatial_dims + 2, type(module).__name__)
        return int(x.shape[0])

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.modules.conv._ConvNd)
        g = output_grad(record)
        if g is None:
            return {}
        batch, k = record.examples, record.group
        c_out = module.out_channels
        out: dict[str, Contribution] = {}
        if "weight" in names:
            x = batched_input(record.args, record.kwargs, self.spatial_dims + 2, "convolution")
            groups = module.groups
            positions = math.prod(g.shape[2:])  # per row; an example has k·positions
            d = (module.in_channels // groups) * math.prod(module.kernel_size)
            forced = "weight" in materialise
            if groups == 1 and (forced or not ghost_is_cheaper(k * positions, d, c_out)):
                with_bias = "bias" in names
                if patches_fit(d + int(with_bias), c_out):
                    rows, bias_rows = per_sample_weight_and_bias(module, x, g, with_bias)
                    if bias_rows is not None:
                        summed = bias_rows if k == 1 else bias_rows.view(batch, k, c_out).sum(1)
                        out["bias"] = Materialised(summed)
                else:
                    rows = per_sample_weight(module, x, g)
                    if with_bias:
                        out["bias"] = Materialised(g.reshape(batch, k, c_out, -1).sum(dim=(1, 3)))
                out["weight"] = Materialised(rows if k == 1 else rows.view(batch, k, *rows.shape[1:]).sum(1))
                return out
            patches = unfold_patches(module, x)
            if k == 1:
                a = patches.view(batch, groups, d, positions).transpose(2, 3)
                gg = g.reshape(batch, groups, c_out // groups, positions).transpose(2, 3)
            else:  # (B·K, G, d, L) -> (B, G, K·L, d): an example's copies become more positions
                a = patches.reshape(batch, k, groups, d, positions).permute(0, 2, 1, 4, 3)
                gg = g.reshape(batch, k, groups, c_out // groups, positions).permute(0, 2, 1, 4, 3)
                a = a.reshape(batch, groups, k * positions, d)
                gg = gg.reshape(batch, groups, k * positions, c_out // groups)
            out["weight"] = grouped_linear(a, gg, module.weight.shape, materialise="weight" in materialise)
        if "bias" in names:
            out["bias"] = Materialised(g.reshape(batch, k, c_out, -1).sum(dim=(1, 3)))
        return out


@register_rule(nn.Conv1d)
class Conv1dRule(_ConvRule):
    """``nn.Conv1d`` on ``[B, C, L]`` inputs."""

    spatial_dims = 1


@register_rule(nn.Conv2d)
class Conv2dRule(_ConvRule):
    """``nn.Conv2d`` on ``[B, C, H, W]`` inputs."""

    spatial_dims = 2
