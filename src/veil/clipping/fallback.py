"""The ``torch.func`` fallback: exact per-sample gradients for any module that owns parameters.

For one call of module ``M`` with inputs ``x`` and output gradients ``G`` captured in the user's
backward pass, example ``i``'s gradient with respect to ``M``'s own parameters ``θ`` is the
vector-Jacobian product ``(∂M(x_i; θ)/∂θ)ᵀ G_i`` of ``M`` run on that example alone (a batch of
one). ``torch.func.vmap`` evaluates it for all examples at once, without a second backward
through the rest of the model. It is exact when ``M``'s forward treats examples independently
and deterministically; both are checked at run time: random operations (dropout) make vmap
refuse, and the recomputed per-example outputs must equal what the batched forward produced,
otherwise the call is refused (a mismatch means the forward mixes examples, e.g. batch
statistics, or is not reproducible).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence, Set
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from veil.clipping._tree import flatten
from veil.clipping.registry import (
    CallRecord,
    Contribution,
    LayerRule,
    Materialised,
    RuleError,
    is_floating,
)

__all__ = ["FunctionalRule"]

_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.complex128: 1e-7, torch.complex64: 1e-4}
_FIX = (
    "make the module's forward deterministic and per-example (no dropout or batch statistics "
    "inside it), or register an exact rule for it with veil.clipping.register_rule"
)


def _close(recomputed: Tensor, captured: Tensor, low_precision: torch.dtype | None) -> bool:
    """Equal up to the rounding of the dtypes involved (``low_precision``: the autocast dtype).

    Where the batched forward gave a NaN or an infinity the values are not compared: it comes from
    an example whose gradient the clipper drops anyway (:func:`veil.clipping.clipped_sum.finite_examples`),
    and a check that failed on it would stop the run because of one record's values. Everywhere else
    the recomputed value must be finite and close: a module that mixes examples in a way that is NaN
    for an example alone (``x.std(0)`` on a batch of one) is still refused."""
    if recomputed.shape != captured.shape:
        return False
    recomputed = recomputed.to(captured.dtype)
    finite = torch.isfinite(captured)
    recomputed, captured = recomputed[finite], captured[finite]
    if not bool(torch.isfinite(recomputed).all()):
        return False
    if captured.numel() == 0:
        return True
    tol = _TOLERANCE.get(captured.dtype, 1e-2)
    if low_precision is not None:
        tol = max(tol, _TOLERANCE.get(low_precision, 1e-2))
    scale = float(captured.abs().max())
    return bool(torch.allclose(recomputed, captured, rtol=tol, atol=tol * max(scale, 1e-30)))


class FunctionalRule(LayerRule):
    """Fallback rule for a module's own (direct) trainable parameters, via ``torch.func``."""

    keep_outputs = True

    def problem(self, module: nn.Module) -> str | None:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                "batch normalisation uses statistics of the whole batch, so each example's output "
                "and gradient depend on the other examples"
            )
        if isinstance(module, nn.RNNBase) and not module.batch_first:
            return (
                "with batch_first=False the examples are in dimension 1, but veil needs them in dimension 0"
            )
        return None

    def input_dims(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int
    ) -> tuple[Any, Any]:
        """Example dimension of each tensor input (same structure as ``(args, kwargs)``; ``None``: shared).

        Default: every tensor whose first dimension has the batch size is split along it.
        """

        def dim(value: Any) -> int | None:
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch:
                return 0
            return None

        leaves, build = flatten((args, kwargs))
        dims: tuple[Any, Any] = build([dim(leaf) for leaf in leaves])
        return dims

    def output_dims(self, module: nn.Module, outputs: Sequence[Tensor]) -> list[int]:
        """Example dimension of each floating-point output leaf."""
        return [0] * len(outputs)

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        batch = record.batch_size
        params = {name: module.get_parameter(name).detach() for name in names}
        # Own buffers are passed as copies, so a forward that updates them in place does not
        # change the module while its gradients are recomputed.
        buffers = {name: b.clone() for name, b in module.named_buffers(recurse=False)}
        leaves, build = flatten((record.args, record.kwargs))
        dim_leaves, _ = flatten(self.input_dims(module, record.args, record.kwargs, batch))
        out_dims = self.output_dims(module, record.outputs)
        for out, d in zip(record.outputs, out_dims, strict=True):
            if out.dim() <= d or out.shape[d] != batch:
                raise RuleError(
                    f"an output of shape {tuple(out.shape)} has no example dimension of size {batch}, "
                    "so it does not come from each example separately",
                    _FIX,
                )
        grads = [
            (g if g is not None else torch.zeros_like(out)).movedim(d, 0)
            for g, out, d in zip(record.grads, record.outputs, out_dims, strict=True)
        ]
        split = [leaf.movedim(d, 0) for leaf, d in zip(leaves, dim_leaves, strict=True) if d is not None]
        autocast: contextlib.AbstractContextManager[Any] = (
            torch.autocast(record.autocast[0], dtype=record.autocast[1])
            if record.autocast is not None
            else contextlib.nullcontext()
        )

        def per_example(
            p: dict[str, Tensor], xs: list[Tensor], gs: list[Tensor]
        ) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
            it = iter(xs)
            rebuilt = [
                leaf if d is None else next(it).unsqueeze(d)
                for leaf, d in zip(leaves, dim_leaves, strict=True)
            ]
            args, kwargs = build(rebuilt)

            def run(q: dict[str, Tensor]) -> tuple[Tensor, ...]:
                with autocast:
                    out = functional_call(module, {**q, **buffers}, tuple(args), kwargs)
                return tuple(t for t in flatten(out)[0] if isinstance(t, Tensor) and is_floating(t))

            pulled = vjp(run, p)
            outs, pullback = pulled[0], pulled[1]
            if len(outs) != len(gs):
                raise RuleError("the module returned a different number of outputs when rerun", _FIX)
            cotangents = tuple(g.unsqueeze(d).to(o.dtype) for g, o, d in zip(gs, outs, out_dims, strict=True))
            (grad_p,) = pullback(cotangents)
            return grad_p, outs

        try:
            per_sample, outs = vmap(per_example, in_dims=(None, 0, 0), randomness="error")(
                params, split, grads
            )
        except RuleError:
            raise
        except Exception as exc:
            raise RuleError(
                f"torch.func could not recompute the module per example ({type(exc).__name__}: {exc})",
                _FIX,
            ) from exc
        for out, captured, d in zip(outs, record.outputs, out_dims, strict=True):
            low = record.autocast[1] if record.autocast is not None else None
            if not _close(out.squeeze(d + 1), captured.movedim(d, 0), low):
                raise RuleError(
                    "its output for each example recomputed alone differs from the batched forward "
                    "(randomness such as dropout, or statistics over the batch)",
                    _FIX,
                )
        return {name: Materialised(per_sample[name]) for name in names}


class SubtreeFunctionalRule(FunctionalRule):
    """The fallback covering every parameter below the module (used by rules that delegate)."""

    subtree = True
