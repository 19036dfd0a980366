"""Reconnect a module output to autograd so the gradient with respect to it can be observed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

_ANCHORS: dict[torch.device, Tensor] = {}


class _Reattach(torch.autograd.Function):
    """Identity whose output requires grad; nothing flows back through it.

    Used when a hooked module's parameters were made not to require grad for its forward and
    none of its inputs requires grad (a first layer): its output would otherwise fall out of the
    graph and the gradient with respect to it could not be observed. ``in_place`` marks the
    tensor itself as the output (no copy; later in-place ops stay legal); otherwise a copy is
    returned.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor, in_place: bool) -> Tensor:
        if in_place:
            ctx.mark_dirty(x)
            return x
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        return None, None, None


def reattach(x: Tensor, inputs: Iterable[Any] = ()) -> Tensor:
    """``x`` made to require grad (gradients reaching it go nowhere further).

    Without a copy when ``x`` is a fresh tensor (not a view, not sharing memory with any of
    ``inputs``), so the user's own tensors never change; otherwise a copy.
    """
    anchor = _ANCHORS.get(x.device)
    if anchor is None:
        anchor = _ANCHORS[x.device] = torch.zeros((), device=x.device, requires_grad=True)
    fresh = x._base is None
    if fresh:
        storage = x.untyped_storage().data_ptr()
        fresh = not any(isinstance(t, Tensor) and t.untyped_storage().data_ptr() == storage for t in inputs)
    out = _Reattach.apply(x, anchor, fresh)
    assert isinstance(out, Tensor)
    return out
