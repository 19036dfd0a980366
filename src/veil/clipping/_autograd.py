"""Reconnect a tensor to autograd so the gradient with respect to it can be captured."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_ANCHOR = torch.zeros((), requires_grad=True)


class _Reattach(torch.autograd.Function):
    """Identity (a copy, so later in-place ops stay legal) whose output requires grad.

    Used when a hooked module's parameters were made not to require grad for its forward and
    none of its inputs requires grad (a first layer): its output would otherwise fall out of
    the graph and the gradient with respect to it could not be observed. Nothing flows back.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        return None, None


def reattach(x: Tensor) -> Tensor:
    """A copy of ``x`` that requires grad (gradients reaching it go nowhere further)."""
    out = _Reattach.apply(x, _ANCHOR)
    assert isinstance(out, Tensor)
    return out
