"""Rule for ``nn.MultiheadAttention``: its in/out projections are captured as linear maps.

``MultiheadAttention`` calls ``F.multi_head_attention_forward``, which applies its projection
weights (``in_proj_weight`` or its row slices, ``q/k/v_proj_weight``, ``out_proj.weight`` and
the biases) only through ``linear``. While the module runs forward, a torch-function mode
redirects that call to PyTorch's own implementation executed with ``linear`` replaced by a
capturing version: it computes the same result with the weights detached (so autograd skips
their summed gradient), keeps the input, and hooks the output to receive its gradient in the
user's backward pass. Each captured projection is then a linear layer with a sequence input, and
its per-sample gradient norm and clipped sum come from the linear rule's ghost or materialised
form; row slices of one parameter cover disjoint rows, so their squared norms add. Everything
else (masks, dropout, softmax) is the original code, so the result is exact with dropout too.

``add_bias_kv=True`` (biases concatenated outside ``linear``) and PyTorch versions whose
implementation does not have this shape use the ``torch.func`` fallback over the whole module.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from veil.clipping._autograd import reattach
from veil.clipping._linear_algebra import grouped_linear
from veil.clipping.fallback import SubtreeFunctionalRule
from veil.clipping.registry import (
    CallRecord,
    Contribution,
    Ghost,
    LayerRule,
    Materialised,
    RuleError,
    register_rule,
    zero_rows,
)

_ACTIVE: list[_Capture] = []


def _capturing_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if _ACTIVE:
        return _ACTIVE[-1].linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _build_forward() -> Callable[..., Any] | None:
    """``F.multi_head_attention_forward`` re-bound so that its ``linear`` calls are captured."""
    names = ("_in_projection_packed", "_in_projection", "multi_head_attention_forward")
    namespace = dict(vars(F))
    if "linear" not in namespace or any(not isinstance(namespace.get(n), types.FunctionType) for n in names):
        return None
    for name in names:
        fn = namespace[name]
        clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        clone.__kwdefaults__ = fn.__kwdefaults__
        namespace[name] = clone
    if "linear" not in namespace["multi_head_attention_forward"].__code__.co_names:
        return None
    namespace["linear"] = _capturing_linear
    built = namespace["multi_head_attention_forward"]
    assert callable(built)
    return built


_FORWARD = _build_forward()


@dataclass
class _Projection:
    """One captured ``linear`` call: input, which parameter rows it used, and its output gradient."""

    x: Tensor
    weight: tuple[str, int] | None
    bias: tuple[str, int] | None
    rows: int
    grad: Tensor | None = None

    def set_grad(self, grad: Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


class _Capture(TorchFunctionMode):
    """Active during one forward of a MultiheadAttention; records its projections."""

    def __init__(self, managed: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.managed = managed
        self.projections: list[_Projection] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and _FORWARD is not None:
            _ACTIVE.append(self)
            try:
                return _FORWARD(*args, **kwargs)
            finally:
                _ACTIVE.pop()
        return func(*args, **kwargs)

    def locate(self, t: Tensor | None) -> tuple[str, int] | None:
        """(name, first row) when ``t`` is a managed parameter or a row slice of one."""
        if t is None:
            return None
        for name, p in self.managed:
            if t is p:
                return name, 0
            if t._base is p:
                offset = t.storage_offset() - p.storage_offset()
                if t.shape[1:] != p.shape[1:] or t.stride() != p.stride() or offset % p.stride(0):
                    raise RuntimeError(f"veil: {name} is used through a view that is not a row slice")
                return name, offset // p.stride(0)
        return None

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        wref, bref = self.locate(weight), self.locate(bias)
        if (wref is None and bref is None) or not torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        out = F.linear(
            x,
            weight.detach() if wref else weight,
            bias.detach() if bref and bias is not None else bias,
        )
        if not out.requires_grad:
            out = reattach(out)
        projection = _Projection(x.detach(), wref, bref, weight.shape[0])
        out.register_hook(projection.set_grad)
        self.projections.append(projection)
        return out


class _AttentionFallback(SubtreeFunctionalRule):
    """The fallback over a whole MultiheadAttention, with its batch dimension conventions."""

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return _batch_size(module, args, kwargs)

    def input_dims(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int
    ) -> tuple[Any, Any]:
        assert isinstance(module, nn.MultiheadAttention)
        seq_dim = 0 if module.batch_first else 1
        positional = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")

        def dim(name: str, value: Any) -> int | None:
            if not isinstance(value, Tensor):
                return None
            if name in ("query", "key", "value"):
                return seq_dim
            if name == "key_padding_mask":
                return 0
            if name == "attn_mask" and value.dim() == 2:
                return None
            raise RuleError(
                f"{name} of shape {tuple(value.shape)} cannot be split per example",
                "pass a 2-d attn_mask shared by all examples (per-example masking: key_padding_mask)",
            )

        return (
            tuple(dim(positional[i] if i < len(positional) else "", v) for i, v in enumerate(args)),
            {k: dim(k, v) for k, v in kwargs.items()},
        )

    def output_dims(self, module: nn.Module, outputs: Sequence[Tensor]) -> list[int]:
        assert isinstance(module, nn.MultiheadAttention)
        return [0 if module.batch_first else 1, 0][: len(outputs)]


def _batch_size(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    assert isinstance(module, nn.MultiheadAttention)
    query = args[0] if args else kwargs.get("query")
    if not isinstance(query, Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, Tensor) else None
        raise ValueError(f"MultiheadAttention needs a batched 3-d query, got shape {shape}")
    return int(query.shape[0 if module.batch_first else 1])


def _as_ghost(c: Contribution) -> Ghost:
    if isinstance(c, Ghost):
        return c
    work = torch.promote_types(c.grads.dtype, torch.float32)

    def summer(grads: Tensor) -> Callable[[Tensor], Tensor]:
        return lambda w: torch.tensordot(w.to(work), grads.to(work), dims=1)

    grads = c.grads
    return Ghost(
        grads.flatten(1).square().sum(dim=1), summer(grads), lambda keep: summer(zero_rows(grads, keep))
    )


def _combine(
    shape: torch.Size, batch: int, parts: list[tuple[int, int, Contribution]], materialise: bool
) -> Contribution:
    """Contributions to disjoint row ranges ``(first, rows, c)`` of one parameter, as one."""
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == shape[0]:
        return parts[0][2]
    if materialise:
        first = next(c for _, _, c in parts)
        ref = first.grads if isinstance(first, Materialised) else first.norm_sq
        full = ref.new_zeros(batch, *shape)
        for row, rows, c in parts:
            assert isinstance(c, Materialised)
            full[:, row : row + rows] += c.grads
        return Materialised(full)
    ghosts = [(row, rows, _as_ghost(c)) for row, rows, c in parts]
    norm_sq = sum((g.norm_sq for _, _, g in ghosts[1:]), ghosts[0][2].norm_sq)

    def summer(sums: list[tuple[int, int, Callable[[Tensor], Tensor]]]) -> Callable[[Tensor], Tensor]:
        def weighted_sum(w: Tensor) -> Tensor:
            pieces = [(row, rows, f(w)) for row, rows, f in sums]
            out = pieces[0][2].new_zeros(shape)
            for row, rows, piece in pieces:
                out[row : row + rows] += piece
            return out

        return weighted_sum

    def without(keep: Tensor) -> Callable[[Tensor], Tensor]:
        kept: list[tuple[int, int, Callable[[Tensor], Tensor]]] = []
        for row, rows, g in ghosts:
            if g.without is None:
                raise RuntimeError("veil: a part of a combined ghost cannot drop examples")
            kept.append((row, rows, g.without(keep)))
        return summer(kept)

    droppable = all(g.without is not None for _, _, g in ghosts)
    whole = summer([(row, rows, g.weighted_sum) for row, rows, g in ghosts])
    return Ghost(norm_sq, whole, without if droppable else None)


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    """All trainable parameters of a MultiheadAttention (including ``out_proj``) as one unit."""

    subtree = True
    toggle_requires_grad = False  # the captured linear calls detach the weights instead
    needs_output_grads = False

    def specialise(self, module: nn.Module) -> LayerRule:
        assert isinstance(module, nn.MultiheadAttention)
        if _FORWARD is None or module.bias_k is not None or module.bias_v is not None:
            return _AttentionFallback()
        return self

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return _batch_size(module, args, kwargs)

    def forward_context(self, module: nn.Module, record: CallRecord) -> _Capture:
        managed = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        capture = _Capture(managed)
        record.extra = capture.projections
        return capture

    def has_gradient(self, record: CallRecord) -> bool:
        return any(p.grad is not None for p in record.extra or ())

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        batch = record.batch_size
        projections: list[_Projection] = record.extra or []
        ranges: dict[str, list[tuple[int, int]]] = {}
        for proj in projections:
            for ref in (proj.weight, proj.bias):
                if ref is not None:
                    ranges.setdefault(ref[0], []).append((ref[1], proj.rows))
        overlapping = {name for name, rs in ranges.items() if _overlap(rs)}
        forced = set(materialise) | overlapping
        parts: dict[str, list[tuple[int, int, Contribution]]] = {}
        for proj in projections:
            if proj.grad is None:
                continue
            a = proj.x.reshape(-1, batch, proj.x.shape[-1]).transpose(0, 1)
            g = proj.grad.reshape(-1, batch, proj.grad.shape[-1]).transpose(0, 1)
            if proj.weight is not None:
                name, row = proj.weight
                shape = torch.Size([proj.rows, a.shape[-1]])
                c = grouped_linear(a.unsqueeze(1), g.unsqueeze(1), shape, materialise=name in forced)
                parts.setdefault(name, []).append((row, proj.rows, c))
            if proj.bias is not None:
                name, row = proj.bias
                parts.setdefault(name, []).append((row, proj.rows, Materialised(g.sum(dim=1))))
        params = dict(module.named_parameters())
        return {
            name: _combine(params[name].shape, batch, parts[name], name in forced)
            for name in names
            if name in parts
        }


def _overlap(ranges: list[tuple[int, int]]) -> bool:
    spans = sorted(ranges)
    return any(a0 + n0 > a1 for (a0, n0), (a1, _) in itertools.pairwise(spans))
