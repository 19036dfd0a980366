"""Rule for ``nn.Linear`` with inputs of any rank ``[B, *, in_features]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

import torch
from torch import Tensor, nn

from veil.clipping._linear_algebra import common_dtype, grouped_linear, summed_positions
from veil.clipping.registry import CallRecord, Contribution, Ghost, LayerRule, register_rule, zero_rows
from veil.clipping.rules._common import batched_input, output_grad


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """``y_t = W x_t + b`` at every position ``t`` of an example; ghost or materialised weight."""

    eager = True
    groups_rows = True  # an example's K copies are K more positions of the same map
    shares_input = True  # query, key and value projections of one input: one Gram matrix

    param_names = ("weight", "bias")

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int(batched_input(args, kwargs, 2, "Linear").shape[0])

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.Linear)
        g = output_grad(record)
        if g is None:
            return {}
        # Rows of one example's group are contiguous: (B·K, *, d) viewed as (B, K·T, d).
        batch = record.examples
        if g.dim() == 2 and record.group == 1 and "weight" not in materialise:
            return _flat_ghost(module, record, g, names)
        out: dict[str, Contribution] = {}
        if "weight" in names:
            x = batched_input(record.args, record.kwargs, 2, "Linear")
            a = x.reshape(batch, 1, -1, module.in_features)
            gg = g.reshape(batch, 1, -1, module.out_features)
            out["weight"] = grouped_linear(
                a, gg, module.weight.shape, materialise="weight" in materialise, grams=record.shared
            )
        if "bias" in names:
            out["bias"] = summed_positions(g, batch, module.out_features)
        return out


def _flat_ghost(
    module: nn.Linear, record: CallRecord, g: Tensor, names: Sequence[str]
) -> dict[str, Contribution]:
    """One position per example: ``‖g aᵀ‖² = ‖g‖²‖a‖²`` and the bias gradient is ``g`` itself."""
    g_sq = torch.linalg.vector_norm(g, dim=1, dtype=_norm_dtype(g)).square()
    out: dict[str, Contribution] = {}
    # Book-keeping sums at ≥ float32 (the norms' precision): low-precision inputs are upcast.
    work = _norm_dtype(g)
    if "weight" in names:
        a, g = common_dtype(batched_input(record.args, record.kwargs, 2, "Linear"), g)
        a_sq = torch.linalg.vector_norm(a, dim=1, dtype=_norm_dtype(a)).square()
        narrow_input = module.in_features < module.out_features
        work = torch.promote_types(work, _norm_dtype(a))

        def weight_summer(a: Tensor, g: Tensor) -> Callable[[Tensor], Tensor]:
            def weight_sum(c: Tensor) -> Tensor:
                aw, gw = a.to(work), g.to(work)
                c = c.to(work).unsqueeze(1)
                return (gw.T @ (aw * c)) if narrow_input else ((gw * c).T @ aw)

            return weight_sum

        def weight_without(keep: Tensor) -> Callable[[Tensor], Tensor]:
            return weight_summer(zero_rows(a, keep), zero_rows(g, keep))

        out["weight"] = Ghost(a_sq * g_sq, weight_summer(a, g), weight_without)
    if "bias" in names:
        bias_g = g

        def bias_summer(g: Tensor) -> Callable[[Tensor], Tensor]:
            return lambda c: c.to(work) @ g.to(work)

        out["bias"] = Ghost(g_sq, bias_summer(bias_g), lambda keep: bias_summer(zero_rows(bias_g, keep)))
    return out


def _norm_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)
