"""Small helpers shared by the built-in rules."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from veil.clipping.registry import CallRecord


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any], name: str = "input") -> Tensor:
    """The module's main input: the first positional argument, or the keyword ``name``."""
    value = args[0] if args else kwargs.get(name)
    if not isinstance(value, Tensor):
        raise ValueError(f"expected a tensor as the first input, got {type(value).__name__}")
    return value


def batched_input(args: tuple[Any, ...], kwargs: dict[str, Any], min_dim: int, what: str) -> Tensor:
    """The main input, checked to have the example dimension in front (at least ``min_dim`` dims)."""
    x = first_input(args, kwargs)
    if x.dim() < min_dim:
        raise ValueError(
            f"{what} got an input of shape {tuple(x.shape)}; per-example gradients need a batch of "
            f"examples in dimension 0 (at least {min_dim} dimensions)"
        )
    return x


def output_grad(record: CallRecord) -> Tensor | None:
    """Gradient of the loss with respect to the module's (single) output."""
    return record.grads[0] if record.grads else None
