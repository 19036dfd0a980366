"""Privacy units in the clipper: rows grouped by a unit label, each unit's gradient the mean of its rows'.

Guarantee (add/remove-one-unit). Given per-row gradients ``g_r`` and a label ``u(r)`` per row,
:func:`unit_means` returns one vector per unit, ``(1/n_u) Σ_{r: u(r)=u} g_r``, computed from that
unit's rows alone; the clipper clips each of those once to ``C``. A unit's whole contribution to the
step's clipped sum is therefore one vector of norm ≤ ``C``, however many rows it has in the batch, and
adding or removing the unit (with all its rows) moves the sum by at most ``C`` — the sensitivity the
DP-SGD accountant assumes for a step over units (:mod:`veil.units` samples them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.errors import InvalidParameterError

__all__ = ["check_unit_index", "unit_means"]


def check_unit_index(units: object) -> None:
    """Refuse anything but a 1-D ``torch.long`` tensor of labels ``≥ 0``."""
    if not isinstance(units, Tensor) or units.dim() != 1 or units.dtype != torch.long:
        raise InvalidParameterError(
            "unit_index",
            type(units).__name__,
            "each row must name its privacy unit so that a unit's rows are clipped together",
            "pass a 1-D torch.long tensor with one label 0..U−1 per row",
        )
    if units.numel() and int(units.min()) < 0:
        raise InvalidParameterError(
            "unit_index", "a negative label", "unit labels index the units of the batch", "use labels 0..U−1"
        )


def unit_means(grads: Tensor, units: Tensor) -> Tensor:
    """``[U, ...]``: row ``u`` is ``(1/n_u) Σ_{r: units[r]=u} grads[r]``; zero for a label with no row.

    ``grads`` is ``[R, ...]`` (one gradient per row); computed at ≥ float32."""
    work = torch.promote_types(grads.dtype, torch.float32)
    units = units.to(grads.device)
    count = int(units.max()) + 1 if units.numel() else 0
    rows_per_unit = torch.bincount(units, minlength=count).to(work)
    weights = (1.0 / rows_per_unit.clamp(min=1))[units].view(-1, *([1] * (grads.dim() - 1)))
    out = torch.zeros((count, *grads.shape[1:]), dtype=work, device=grads.device)
    return out.index_add_(0, units, grads.to(work) * weights)
