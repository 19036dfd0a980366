"""Per-sample gradients of a (grouped) linear map, ghost or materialised.

For one example with inputs ``a_t`` (``d``-vectors) and output gradients ``g_t`` (``p``-vectors)
at positions ``t = 1..T`` (sequence positions, or the output pixels of a convolution), the
weight gradient is ``W_i = Σ_t g_t a_tᵀ`` (``p × d``). Two exact ways to get what clipping needs:

* materialise ``W_i`` for every example: ``O(B·T·d·p)`` time, ``B·d·p`` memory, and the
  clipped sum is then a cheap weighted sum of the ``W_i``;
* ghost norm: ``‖W_i‖²_F = Σ_{t,s} (a_t·a_s)(g_t·g_s)``, ``O(B·T²·(d+p))`` time and ``B·T²``
  memory, then book-keeping forms ``Σ_i c_i W_i = Σ_{i,t} (c_i g_t) a_tᵀ`` as one matmul.

The ghost form is chosen when ``T·(d+p) < d·p``: there it is cheaper, and materialising would
hold more memory than the activations ``B·T·(d+p)`` already kept for the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from veil.clipping.registry import Contribution, Ghost, Materialised, zero_rows

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def ghost_is_cheaper(positions: int, d: int, p: int) -> bool:
    """Whether the ghost norm beats materialising for ``positions`` positions of a ``p × d`` map."""
    return positions * (d + p) < d * p


def common_dtype(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``g`` in one dtype (they differ under autocast: inputs float32, gradients bf16)."""
    if a.dtype == g.dtype:
        return a, g
    dtype = torch.promote_types(a.dtype, g.dtype)
    return a.to(dtype), g.to(dtype)


def _precise(t: Tensor) -> Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t


def grouped_linear(
    a: Tensor, g: Tensor, shape: torch.Size, *, materialise: bool, grams: dict[Any, Tensor] | None = None
) -> Contribution:
    """Per-sample gradient of a grouped linear map's weight.

    ``a``: ``[B, G, T, d]`` inputs and ``g``: ``[B, G, T, p]`` output gradients (any strides);
    the weight is ``G`` blocks of ``p × d`` (group-major), viewed as ``shape``. ``grams``: a cache
    shared by maps applied to the same input (see :attr:`~veil.clipping.registry.CallRecord.shared`):
    the input's Gram matrices ``a aᵀ`` are computed once for all of them.
    """
    batch, groups, positions, d = a.shape
    p = g.shape[-1]
    a, g = common_dtype(a, g)
    if materialise or not ghost_is_cheaper(positions, d, p):
        if groups == 1:
            grads = torch.bmm(g[:, 0].transpose(1, 2), a[:, 0])
        else:
            grads = torch.einsum("bgtp,bgtd->bgpd", g, a)
        return Materialised(grads.reshape(batch, *shape))
    ap, gp = _precise(a), _precise(g)
    if positions == 1:
        a_sq = torch.linalg.vector_norm(ap, dim=-1).square()
        g_sq = torch.linalg.vector_norm(gp, dim=-1).square()
        norm_sq = (a_sq * g_sq).sum(dim=(1, 2))
    elif groups == 1:
        a0, g0 = ap[:, 0], gp[:, 0]
        aa = _input_gram(a0, grams)
        # the output gradients' Gram matrix is this call's own: the product is written over it
        # (aa may be shared with the other maps on the same input)
        gg = torch.bmm(g0, g0.transpose(1, 2))
        norm_sq = gg.mul_(aa).sum(dim=(1, 2))
    else:
        aa = torch.einsum("bgtd,bgsd->bgts", ap, ap)
        gg = torch.einsum("bgtp,bgsp->bgts", gp, gp)
        norm_sq = (aa * gg).sum(dim=(1, 2, 3))

    def summer(ap: Tensor, gp: Tensor) -> Callable[[Tensor], Tensor]:
        def weighted_sum(c: Tensor) -> Tensor:
            # at ≥ float32 (the precision of the norms above), so the sum matches what was measured
            c = c.to(torch.promote_types(c.dtype, gp.dtype))
            gq, aq = gp.to(c.dtype), ap.to(c.dtype)
            if groups == 1:
                flat_g = gq.reshape(batch, positions * p) if positions == 1 else gq
                flat_a = aq.reshape(batch, positions * d) if positions == 1 else aq
                # scale the narrower operand by the per-example weights
                if d < p:
                    flat_a = flat_a * c.view(batch, *([1] * (flat_a.dim() - 1)))
                else:
                    flat_g = flat_g * c.view(batch, *([1] * (flat_g.dim() - 1)))
                return (flat_g.reshape(-1, p).T @ flat_a.reshape(-1, d)).reshape(shape)
            return torch.einsum("bgtp,bgtd->gpd", gq * c.view(batch, 1, 1, 1), aq).reshape(shape)

        return weighted_sum

    return Ghost(norm_sq, summer(ap, gp), lambda keep: summer(zero_rows(ap, keep), zero_rows(gp, keep)))


def _input_gram(a: Tensor, grams: dict[Any, Tensor] | None) -> Tensor:
    """``a aᵀ`` per example (``a``: ``[B, T, d]``), from ``grams`` when a map on the same input made it.

    Keyed by what the product depends on besides the input tensor itself (its view's shape and
    dtype), so a map that sees the input regrouped or upcast differently computes its own.
    """
    key = ("gram", tuple(a.shape), a.dtype)
    if grams is not None and key in grams:
        return grams[key]
    aa = torch.bmm(a, a.transpose(1, 2))
    if grams is not None:
        grams[key] = aa
    return aa


def summed_positions(g: Tensor, batch: int, p: int) -> Materialised:
    """Per-sample bias gradient ``Σ_t g_t`` from output gradients with ``p`` features last."""
    flat = g.reshape(batch, -1, p)
    return Materialised(flat[:, 0] if flat.shape[1] == 1 else flat.sum(dim=1))
