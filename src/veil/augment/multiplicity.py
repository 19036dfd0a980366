"""Augmentation multiplicity: each example's K augmented gradients averaged, then clipped.

Two implementations. In training (``veil train --augment K``) the clipper does it in the ordinary
backward pass: :func:`expand` lays each example's K copies out as K consecutive rows, the loss is
the mean over all rows (each example's term is the mean of its copies'), and the clipper, told
``group_size = K`` (:attr:`veil.clipping.PerSampleClipper.group_size`), clips the sum of each
group's row gradients, the layer rules treating the K copies as K more positions of one example
(exact ghost norms for Linear and convolutions). :func:`averaged_clipped_sum` is the ``torch.func``
reference, one vmapped gradient per example.

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

from veil.augment.ops import augment
from veil.errors import ConfigError

__all__ = ["averaged_clipped_sum", "default_pad", "expand", "refuse_unsupported"]


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


def expand(
    x: torch.Tensor, y: torch.Tensor, k: int, gen: torch.Generator, *, flip: bool = False, pad: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``K`` augmentations of each image of ``x`` ``[B, C, H, W]``, as ``[B·K, C, H, W]`` rows where
    rows ``i·K .. i·K + K − 1`` are example ``i``'s copies, and the labels repeated alike.

    Each copy is an independent draw of :func:`veil.augment.ops.augment` (a shift by up to ``pad``
    pixels, then a left-right flip when ``flip``) from ``gen``: data-independent randomness, so
    the privacy analysis holds for every draw."""
    if k == 1 or x.shape[0] == 0:
        return x, y
    views = torch.stack([augment(x, gen, flip=flip, pad=pad) for _ in range(k)], dim=1)
    return views.reshape(x.shape[0] * k, *x.shape[1:]), y.repeat_interleave(k)


def default_pad(input_shape: tuple[int, ...]) -> int:
    """The shift range for ``input_shape`` images: 2 pixels from 20×20 up (De et al.: 4 of 32), else 1."""
    return 2 if min(input_shape[1:]) >= 20 else 1


def refuse_unsupported(
    k: int, kind: str, input_shape: tuple[int, ...], model: str, fixed_front: bool
) -> None:
    """Refuse ``--augment K > 1`` where it cannot apply (before anything is written).

    Augmentations act on raw images, so the data must be images and the model must train end to
    end on them: a fixed front (``rff``, ``scatternet``, a frozen encoder's features) computes each
    example's features once, before training, and would need them recomputed for every copy."""
    if k == 1:
        return
    if kind != "image" or len(input_shape) != 3:
        raise ConfigError(
            "augment",
            k,
            f"augmentation multiplicity shifts and flips images, and this data has shape {input_shape}",
            "drop --augment for tables and text",
        )
    if fixed_front:
        raise ConfigError(
            "augment",
            k,
            f"the model {model!r} has a fixed feature front whose features are computed once per example "
            "before training, so augmented copies would never reach it",
            "train an end-to-end model with --augment (--model cnn, mlp or logreg), or drop --augment",
        )
