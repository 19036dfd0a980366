"""Augmentation multiplicity: each example's K augmented gradients averaged, then clipped.

Guarantee (add/remove-one). For example i with augmentations a_1..a_K (drawn independently of the
data), the contribution to the step's sum is ``clip_C((1/K) Σ_k ∇ℓ(θ; a_k(x_i), y_i))``: one
vector per example, of norm at most C, computed from that example alone. The clipped sum's
sensitivity is therefore C, exactly as without augmentation, and the step is the same
Poisson-sampled Gaussian event. Clipping each augmented copy separately would instead let one
example contribute K clipped vectors (sensitivity K·C); this module never does that.

Per-example gradients come from ``torch.func`` (``vmap`` over examples of ``grad`` of the mean loss
over the example's K copies), for any model with no batch-coupling layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = ["averaged_clipped_sum"]


def averaged_clipped_sum(
    model: nn.Module,
    views: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``views``: ``[B, K, ...]`` (K augmentations of each of B examples), ``y``: ``[B]``.

    Returns the sum over examples of each example's clipped averaged gradient (per parameter name)
    and the ``[B]`` norms of the averaged gradients before clipping."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def example_loss(p: dict[str, torch.Tensor], xs: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xs,))
        return loss_fn(out, label.expand(xs.shape[0]))  # mean over the example's K copies

    grads = vmap(grad(example_loss), in_dims=(None, 0, 0))(params, views, y)
    b = views.shape[0]
    norms = torch.sqrt(sum(g.reshape(b, -1).pow(2).sum(dim=1) for g in grads.values()))
    scale = torch.clamp(max_grad_norm / (norms + 1e-12), max=1.0)
    summed = {k: torch.einsum("b,b...->...", scale, g) for k, g in grads.items()}
    return summed, norms
