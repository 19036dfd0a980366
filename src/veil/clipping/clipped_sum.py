"""The clipped sum: clip factors from the per-example norms, applied inside one weighted sum per parameter.

Flat clipping: ``c_i = min(1, C / ‖g_i‖)``; per-layer: ``c_ik = min(1, C_k / ‖g_ik‖)`` per group.
The factors are computed at ≥ float32, times the loss-scale factor and the rounding margin
(:func:`rounding_margin`), and applied as ``Σ_i c_i g_i``: one weighted matmul for materialised
gradients, the rule's own weighted sum for ghost ones (book-keeping: no second backward pass). Each
parameter's sum is formed at its dtype promoted to at least float32 (:func:`sum_dtypes`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from veil.clipping.norms import Norms
from veil.clipping.registry import Ghost, zero_rows

__all__ = ["STABILITY", "clip_weights", "finite_examples", "rounding_margin", "sum_dtypes", "weighted_sums"]

STABILITY = 1e-12


def sum_dtypes(parameters: list[nn.Parameter]) -> dict[int, torch.dtype]:
    """Accumulator dtype per parameter: the parameter's own, at least float32."""
    return {id(p): torch.promote_types(p.dtype, torch.float32) for p in parameters}


def rounding_margin(parameters: list[nn.Parameter]) -> float:
    """``1 - 2u`` for the coarsest parameter dtype (unit roundoff ``u``: bf16 2⁻⁸, fp16 2⁻¹¹).

    Clip factors are computed at ≥ float32 and multiplied by this margin, so that a contribution
    rounded to its parameter's dtype (one rounding per coordinate, relative error ≤ u) keeps
    norm ≤ C, with u of slack left for float32 arithmetic in the norms and the weighted sums.
    """
    roundoff = max((torch.finfo(p.dtype).eps / 2 for p in parameters), default=0.0)
    return 1.0 - 2.0 * roundoff


def clip_weights(
    squares: list[list[Tensor]],
    bounds: list[float],
    clipping: Literal["flat", "per_layer"],
    scale: float,
    margin: float,
    batch: int,
    norm_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, list[Tensor]]:
    """``(flat per-example norms [B], one weight vector [B] per group)``: ``c_i · scale · margin``."""

    def total(parts: list[Tensor]) -> Tensor:
        if not parts:
            return torch.zeros(batch, dtype=norm_dtype, device=device)
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)

    if clipping == "flat":
        flat_norms = total([t for parts in squares for t in parts]).sqrt() * scale
        weight = torch.clamp(bounds[0] / (flat_norms + STABILITY), max=1.0) * (scale * margin)
        return flat_norms, [weight] * len(squares)
    group_sq = torch.stack([total(parts) for parts in squares])
    flat_norms = group_sq.sum(dim=0).sqrt() * scale
    limits = torch.tensor(bounds, dtype=norm_dtype, device=device).unsqueeze(1)
    factors = torch.clamp(limits / (group_sq.sqrt() * scale + STABILITY), max=1.0)
    return flat_norms, list((factors * (scale * margin)).unbind(0))


def finite_examples(flat_norms: Tensor) -> Tensor | None:
    """``None`` when every example's norm is finite, else the ``[B]`` mask of those whose is.

    The per-record rule for a gradient that is not finite (a NaN or an infinity from the example's
    own input or loss, or a norm whose square overflows): the example adds exactly zero to the
    step's sum, as if its gradient were zero. The rule reads the example's own norm only, so
    whether one record is dropped never depends on another, and the guarantee (each example's
    contribution has norm ≤ C) holds for it trivially. Without it, ``0 · inf`` in the weighted sums
    would make every parameter the record touches NaN: a released model that reveals the record.
    One host synchronisation per physical batch (a ``[B]`` reduction).
    """
    finite = torch.isfinite(flat_norms)
    return None if bool(finite.all()) else finite


def weighted_sums(
    norms: Norms,
    weights: list[Tensor],
    group_of: dict[int, int],
    dtypes: dict[int, torch.dtype],
    batch: int,
    norm_dtype: torch.dtype,
    keep: Tensor | None = None,
    numels: dict[int, int] | None = None,
) -> dict[int, Tensor]:
    """id(parameter) → ``Σ_i w_i g_i`` at ≥ float32 (weights never cast down; one rounding to the sum).

    ``keep`` (from :func:`finite_examples`): only those examples are summed; the others' gradients
    or ghost operands are replaced by zeros (their weights must be 0 too), so a NaN or an infinity
    in a dropped example never reaches the sum.

    Consumes ``norms``: each parameter's per-example gradients or ghost operands leave it as soon as
    its sum is formed, so they are freed one by one while the sums are built (memory: the operands of
    every layer and the sums of every parameter are never all held at once). ``numels``: id(parameter)
    → its size; given, the ghost sums are formed smallest parameter first, so the largest sums (a
    vocabulary's embedding: 47 MB for MiniLM, whose own operands are small) are allocated once the
    other layers' operands are freed. A parameter's own parts keep their order (a stable sort), so
    every sum is the same, bit for bit, in either order.
    """
    added: dict[int, Tensor] = {}
    for pid in list(norms.materialised):
        grads = norms.materialised.pop(pid)
        if keep is not None:
            grads = zero_rows(grads, keep)
        work = torch.promote_types(grads.dtype, norm_dtype)
        w = weights[group_of[pid]].to(work)
        added[pid] = (w @ grads.reshape(batch, -1).to(work)).view(grads.shape[1:]).to(dtypes[pid])
        del grads
    if numels is not None:  # stable: equal sizes (a parameter's own parts) keep their order
        norms.ghosts.sort(key=lambda item: numels.get(item[0], 0))
    norms.ghosts.reverse()  # popped from the end, in the order above
    while norms.ghosts:
        pid, ghost = norms.ghosts.pop()
        part = _ghost_sum(ghost, weights[group_of[pid]], keep).to(dtypes[pid])
        del ghost
        added[pid] = part if pid not in added else added[pid] + part
    return added


def _ghost_sum(ghost: Ghost, weights: Tensor, keep: Tensor | None) -> Tensor:
    if keep is None:
        return ghost.weighted_sum(weights)
    assert ghost.without is not None  # a Ghost without it is refused when collected (norms.collect)
    return ghost.without(keep)(weights)
