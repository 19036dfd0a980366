"""Rule for ``nn.Embedding`` (``padding_idx`` and ``max_norm`` included).

Example ``i``'s gradient has a row for each distinct index it looks up: the sum of the output
gradients at the positions holding that index (positions at ``padding_idx`` get none). Its norm
is computed exactly by summing rows per (example, index) pair, ``O(B·T·D)`` after a sort, and
the clipped sum is one ``index_add`` of the weighted output gradients (book-keeping), so the
``B × V × D`` per-sample gradients are never formed unless a tied weight needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

import torch
from torch import Tensor, nn

from veil.clipping.registry import (
    CallRecord,
    Contribution,
    Ghost,
    LayerRule,
    Materialised,
    register_rule,
    zero_rows,
)
from veil.clipping.rules._common import batched_input, output_grad


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    """``y_t = W[idx_t]``."""

    eager = True

    param_names = ("weight",)

    def problem(self, module: nn.Module) -> str | None:
        assert isinstance(module, nn.Embedding)
        if module.scale_grad_by_freq:
            return (
                "scale_grad_by_freq=True divides gradients by token counts over the whole batch, "
                "so one example changes every other example's gradient"
            )
        return None

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int(batched_input(args, kwargs, 1, "Embedding").shape[0])

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.Embedding)
        g = output_grad(record)
        if g is None or "weight" not in names:
            return {}
        batch, vocab, dim = record.batch_size, module.num_embeddings, module.embedding_dim
        idx = batched_input(record.args, record.kwargs, 1, "Embedding").reshape(batch, -1)
        rows_of = torch.arange(batch, device=idx.device).unsqueeze(1).expand_as(idx)
        # ≥ float32: row sums, norms and the weighted sum all at one precision (see the clipper's
        # low-precision guarantee)
        work = torch.promote_types(torch.promote_types(g.dtype, module.weight.dtype), torch.float32)
        grads = g.reshape(batch, -1, dim).to(work)
        if module.padding_idx is not None:
            keep = idx != module.padding_idx
            example, index, grad = rows_of[keep], idx[keep], grads[keep]
        else:
            example, index, grad = rows_of.reshape(-1), idx.reshape(-1), grads.reshape(-1, dim)

        if "weight" in materialise:
            full = grad.new_zeros(batch, vocab, dim)
            full.index_put_((example, index), grad, accumulate=True)
            return {"weight": Materialised(full)}

        key = example * vocab + index
        unique, inverse = torch.unique(key, return_inverse=True)
        summed = grad.new_zeros(unique.shape[0], dim).index_add_(0, inverse, grad)
        norm_sq = grad.new_zeros(batch).index_add_(0, unique // vocab, summed.square().sum(dim=1))

        def summer(grad: Tensor) -> Callable[[Tensor], Tensor]:
            def weighted_sum(c: Tensor) -> Tensor:
                weights = c.to(grad.dtype)[example].unsqueeze(1)
                return grad.new_zeros(vocab, dim).index_add_(0, index, grad * weights)

            return weighted_sum

        # a dropped example's looked-up rows are its own (``example`` names the row's example)
        return {"weight": Ghost(norm_sq, summer(grad), lambda keep: summer(zero_rows(grad, keep[example])))}
