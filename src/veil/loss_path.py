"""Is the path from the model's output to a loss module's input row-local?

The engine's loss contract (:mod:`veil.per_example_loss`) needs each loss term to depend on one
example. A loss module applied to the model's output after an op that mixes the batch — a softmax
over dimension 0, ``out - out.mean(0)``, a row selection, a transpose of the batch dimension —
makes every example's gradient depend on the others, so adding one example can move the clipped
sum by up to ``n·C`` (measured: 32 C at n = 32). This module walks the autograd graph from the
loss input back to the watched model outputs (no depth limit; each node visited once, so the cost
is bounded by the graph's size) and accepts the path only if every node on it is an allow-listed
row-wise op.

Guarantee: if :func:`trace_to_outputs` finds no problem, every element of the loss input is computed, by
differentiable ops, from the rows of *one* example of each model output it derives from (rows are
dimension 0, examples in dimension 0 as everywhere in veil). Tracked per tensor: ``g``, the number
of consecutive dimension-0 rows each example owns (1 at the model output; ``T`` after
``out.view(-1, V)`` of ``[B, T, V]``). Not seen: values reaching the loss without a gradient path
(a detached tensor, a mask or condition computed from the output, a Python number such as
``len(out)``) and tensors taken from inside the model rather than from its output.
Batches of at most one example are accepted whatever the ops (nothing to mix).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["PathVerdict", "trace_to_outputs"]

Edge = tuple[Any, int]  # (autograd node, output number)

# fmt: off
_ELEMENTWISE = frozenset([
    "Add", "Sub", "Rsub", "Mul", "Div", "Neg", "Exp", "Exp2", "Expm1", "Log", "Log2", "Log10",
    "Log1p", "Log1P", "Sigmoid", "LogSigmoid", "Tanh", "Relu", "Threshold", "Clamp", "ClampMin", "ClampMax",
    "Abs", "Pow", "Sqrt", "Rsqrt", "Reciprocal", "Softplus", "Where", "NanToNum", "ToCopy", "Clone",
    "Alias", "Sign", "Sin", "Cos", "Maximum", "Minimum", "Fmax", "Fmin", "Addcmul", "Addcdiv",
    "Lerp", "Erf", "Erfc", "Gelu", "Silu", "Elu", "LeakyRelu", "Hardtanh", "Hardsigmoid",
    "Hardswish", "Mish", "MaskedFill", "Floor", "Ceil", "Round", "Trunc", "Xlogy", "Logit",
    "NativeDropout",
])
"""Ops that act element by element (after broadcasting): derived inputs must keep rank and rows."""
_ALONG_DIMS = frozenset([
    "Softmax", "LogSoftmax", "Mean", "Sum", "Amax", "Amin", "Max", "Min", "Logsumexp",
    "LinalgVectorNorm", "Norm", "Std", "Var", "Prod", "Cumsum", "Cumprod", "Logcumsumexp",
    "Gather", "IndexSelect", "Select", "Unbind", "Split", "SplitWithSizes", "Sort", "Topk",
    "Median", "Kthvalue",
])
"""Ops that act within each row along their saved dim(s): the dims must not include 0."""
# fmt: on
_SIGNED = 1 << 63


def _base(node: Any) -> str:
    """``MeanBackward1`` → ``Mean``."""
    return type(node).__name__.rstrip("0123456789").removesuffix("Backward")


def _dims(raw: Any, rank: int) -> set[int] | None:
    """The saved dim(s) normalised to ``0..rank-1`` (torch stores -1 as 2**64 - 1); None when the
    op has no saved dim (a full reduction)."""
    if raw is None:
        return None
    values = list(raw) if isinstance(raw, (tuple, list)) else [raw]
    if not values:
        return None
    out = set()
    for v in values:
        v = int(v) - (1 << 64) if int(v) >= _SIGNED else int(v)
        out.add(v % rank if rank else 0)
    return out


def _key(node: Any, nr: int) -> Edge:
    return (id(node), nr)


def _rule(node: Any, out: tuple[int, ...], derived: list[tuple[int, tuple[int, ...], int]]) -> int | str:
    """``g`` of ``node``'s output, or why the node is not row-local. ``derived`` lists
    ``(position, shape, g)`` of the inputs that come from the model's output."""
    name, rank = _base(node), len(out)
    if rank == 0:
        return "reduces every row to one value"
    gs = {g for _, _, g in derived}
    if len(gs) != 1:
        return "combines tensors whose rows belong to examples in different layouts"
    (g,) = gs
    shapes = [s for _, s, _ in derived]
    if name in _ELEMENTWISE or name == "Expand":
        if any(len(s) != rank or s[0] != out[0] for s in shapes):
            return "broadcasts across the batch dimension"
        return g
    in_shape = shapes[0]
    if name in _ALONG_DIMS:
        dims = _dims(getattr(node, "_saved_dim", None), len(in_shape))
        if dims is None or 0 in dims:
            return "acts along the batch dimension 0"
        return g if out[0] == in_shape[0] else "changes the number of rows"
    if name in ("View", "UnsafeView", "ReshapeAlias"):
        examples = in_shape[0] // g
        return out[0] // examples if examples and out[0] % examples == 0 else "regroups rows across examples"
    if name in ("Squeeze", "Unsqueeze", "Permute", "Transpose", "T", "Slice", "Index", "Cat", "Stack"):
        return _shape_rule(node, name, in_shape, out, g)
    if name in ("Mm", "Addmm", "Bmm", "NativeLayerNorm"):
        return _product_rule(node, name, derived, out, g)
    return "is not on veil's list of row-wise ops"


def _shape_rule(node: Any, name: str, in_shape: tuple[int, ...], out: tuple[int, ...], g: int) -> int | str:
    """Rows are kept by shape ops that leave dimension 0 in place."""
    if name == "Squeeze":  # a batch of ≥ 2 rows is never squeezed away
        return g if out[0] == in_shape[0] else "removes the batch dimension"
    if name == "Unsqueeze":
        return "adds a dimension before the batch" if _dims(node._saved_dim, len(out)) == {0} else g
    if name == "Permute":
        dims = list(node._saved_dims)
        return g if _dims(dims[0], len(dims)) == {0} else "moves the batch dimension"
    if name in ("Transpose", "T"):
        swapped = _dims([node._saved_dim0, node._saved_dim1], len(out)) if name == "Transpose" else None
        return g if len(out) < 2 or 0 not in (swapped or {0}) else "moves the batch dimension"
    if name == "Slice":
        whole = (node._saved_start or 0) == 0 and node._saved_step == 1
        if _dims(node._saved_dim, len(in_shape)) != {0} or (whole and node._saved_end >= in_shape[0]):
            return g
        return "selects rows of the batch"
    if name == "Index":
        used = [i for i, t in enumerate(node._saved_indices) if t is not None]
        adjacent = not used or used == list(range(used[0], used[-1] + 1))
        return g if used and used[0] > 0 and adjacent else "indexes the batch dimension"
    if name == "Cat":
        return g if _dims(node._saved_dim, len(out)) != {0} else "concatenates along the batch dimension"
    return g if _dims(node._saved_dim, len(out)) != {0} else "stacks along the batch dimension"  # Stack


def _product_rule(
    node: Any, name: str, derived: list[tuple[int, tuple[int, ...], int]], out: tuple[int, ...], g: int
) -> int | str:
    """Matrix products are row-wise when only the row operand (and an added term, or the other
    factor of a batched product) comes from the output; a layer norm when only its input does and
    its normalised shape leaves dimension 0 out."""
    row_operands = {"Mm": {0}, "Addmm": {0, 1}, "Bmm": {0, 1}, "NativeLayerNorm": {0}}[name]
    if not {p for p, _, _ in derived} <= row_operands:
        return "multiplies by a matrix computed from the batch"
    if any(len(s) != len(out) or s[0] != out[0] for _, s, _ in derived):
        return "broadcasts across the batch dimension"
    if name == "NativeLayerNorm" and len(node._saved_normalized_shape) >= len(out):
        return "normalises across the batch dimension"
    return g


def _walk(start: Edge, sources: Mapping[Edge, tuple[int, ...]]) -> list[Any]:
    """Post-order list of the nodes between ``start`` and the sources (each node once)."""
    order, seen, stack = [], set(), [(start[0], iter(start[0].next_functions))]
    seen.add(id(start[0]))
    while stack:
        node, children = stack[-1]
        for child, nr in children:
            if child is None or _key(child, nr) in sources or id(child) in seen:
                continue
            seen.add(id(child))
            stack.append((child, iter(child.next_functions)))
            break
        else:
            stack.pop()
            order.append(node)
    return order


class PathVerdict(NamedTuple):
    """Whether a tensor derives from the model's outputs, and if so why it is not row-local
    (None: it is)."""

    derived: bool
    problem: str | None


def trace_to_outputs(tensor: Any, sources: Mapping[Edge, tuple[int, ...]]) -> PathVerdict:
    """Check the autograd path from the model's outputs to ``tensor`` (a loss input).

    ``sources`` maps each watched output, as ``(id(grad_fn), output_nr)``, to its shape. See the
    module docstring for what is and is not seen.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
        return PathVerdict(False, None)
    start = (tensor.grad_fn, tensor.output_nr)
    if _key(*start) in sources:
        scalar = not sources[_key(*start)]
        return PathVerdict(True, "the model's output is a scalar" if scalar else None)
    g_of: dict[int, int] = {}  # id(node) → g of its output (0: all of it from one example)
    for node in _walk(start, sources):
        derived = list(_derived_inputs(node, sources, g_of))
        if not derived:
            continue
        if any(g == 1 and not shape for _, shape, g in derived):
            return PathVerdict(True, "the model's output is a scalar")
        if all(g == 0 or shape[0] <= 1 for _, shape, g in derived):
            g_of[id(node)] = 0  # one example: nothing to mix
            continue
        g = _rule(node, tuple(node._input_metadata[0].shape), derived)
        if isinstance(g, str):
            return PathVerdict(True, f"{type(node).__name__} {g}")
        g_of[id(node)] = g
    return PathVerdict(id(start[0]) in g_of, None)


def _derived_inputs(
    node: Any, sources: Mapping[Edge, tuple[int, ...]], g_of: Mapping[int, int]
) -> Iterable[tuple[int, tuple[int, ...], int]]:
    """``(position, shape, g)`` of each of ``node``'s inputs that derives from the sources."""
    for position, (child, nr) in enumerate(node.next_functions):
        if child is None:
            continue
        if _key(child, nr) in sources:  # a model output: one row per example
            yield position, sources[_key(child, nr)], 1
        elif id(child) in g_of:
            yield position, tuple(child._input_metadata[nr].shape), g_of[id(child)]
