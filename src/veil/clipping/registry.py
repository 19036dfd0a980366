"""Per-layer rules for per-sample gradients, and the registry that finds the rule of a module.

A rule turns what one forward call of a module left behind (its inputs, its outputs, and the
gradient of the loss with respect to those outputs, captured during the user's single backward
pass) into each example's contribution to the gradient of the module's parameters, in one of
two forms:

* :class:`Materialised`: the per-sample gradients themselves, shape ``[B, *param.shape]``;
* :class:`Ghost`: only the per-sample squared norms ``[B]`` plus a function that forms the
  weighted sum ``Σ_i c_i g_i`` directly from activations and output gradients (book-keeping),
  so per-sample gradients are never stored.

Both forms are exact; a rule picks the cheaper one per layer and call. Lookup walks the MRO, so
a subclass of ``nn.Linear`` uses the Linear rule, unless the subclass overrides ``forward``
(its math may differ): such a module, like any module without a rule, falls back to the
``torch.func`` rule, which is exact for any deterministic per-example forward.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import torch
from torch import Tensor, nn

__all__ = [
    "CallRecord",
    "Contribution",
    "Ghost",
    "LayerRule",
    "Materialised",
    "RuleError",
    "find_rule",
    "register_rule",
    "zero_rows",
]


@dataclass
class Materialised:
    """Per-sample gradients ``[B, *param.shape]`` of the loss autograd saw (not yet rescaled)."""

    grads: Tensor


@dataclass
class Ghost:
    """Per-sample squared gradient norms ``[B]`` and a book-keeping weighted sum.

    ``weighted_sum(c)`` returns ``Σ_i c_i g_i`` (shaped like the parameter, a new tensor the
    clipper may keep and modify) for per-example weights ``c`` of shape ``[B]``, without forming
    any ``g_i``. It computes at ≥ float32 (low-precision inputs upcast, ``c`` never cast down), so
    the sum carries the clip factors at the precision its norms were measured at.

    ``without(keep)`` (``keep``: a ``[B]`` boolean mask) returns the same kind of function over
    the kept examples only: the others' operands are replaced by zeros, so an example whose
    gradient is not finite (a NaN or an infinity in its inputs or output gradients) adds exactly
    zero instead of turning ``0 · inf`` into a NaN in everyone's sum. The clipper calls it only
    when some example's norm is not finite (see :mod:`veil.clipping.clipped_sum`). ``None``: the
    rule cannot drop examples, and a non-finite example is refused for it.
    """

    norm_sq: Tensor
    weighted_sum: Callable[[Tensor], Tensor]
    without: Callable[[Tensor], Callable[[Tensor], Tensor]] | None = None


def zero_rows(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` (examples first) with the rows where ``keep`` is false set to exactly 0 (NaN and
    infinities included: a selection, not a product)."""
    return torch.where(keep.to(x.device).view(-1, *([1] * (x.dim() - 1))), x, x.new_zeros(()))


Contribution = Union[Materialised, Ghost]  # noqa: UP007  (a runtime alias on Python 3.10)


class RuleError(Exception):
    """A rule cannot produce exact per-sample gradients for a call; the clipper names the module."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


@dataclass
class CallRecord:
    """What one forward call of a hooked module left for its rule.

    ``args``/``kwargs`` are the call's inputs with tensors detached; ``grads[k]`` is the gradient
    of the loss with respect to the k-th tensor leaf of the output (``None`` when no gradient
    reached it); ``outputs`` holds those leaves (detached) only for rules that ask for them;
    ``autocast`` is ``(device_type, dtype)`` when the forward ran under ``torch.autocast``;
    ``extra`` is rule-private state (e.g. captured sub-computations); ``shared`` (rules with
    ``shares_input``) is one dict for every call of the backward pass whose first input was the
    same tensor, unmodified (the same object at the same version), where a rule may keep what it
    computes from that input alone, such as a Linear's Gram matrix, for the other calls.

    ``group`` (augmentation multiplicity, :mod:`veil.augment`): rows ``i·K .. i·K + K − 1`` of the
    call are the ``K`` augmented copies of example ``i``, and the example's gradient is the sum of
    its rows' (the loss averages each example's copies). ``batch_size`` still counts rows.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_size: int
    grads: list[Tensor | None] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    autocast: tuple[str, torch.dtype] | None = None
    extra: Any = None
    group: int = 1
    shared: dict[Any, Tensor] | None = None

    @property
    def examples(self) -> int:
        """Examples in the call: ``batch_size`` rows in groups of ``group``."""
        return self.batch_size // self.group

    def has_gradient(self) -> bool:
        return any(g is not None for g in self.grads)


class LayerRule:
    """Base class of a per-sample gradient rule; subclass and decorate with :func:`register_rule`.

    Class attributes tune how the clipper hooks the module:

    * ``subtree``: the rule covers the parameters of the module's descendants too (their own
      rules are then not used), e.g. attention whose ``out_proj`` is called functionally;
    * ``toggle_requires_grad``: while the module runs forward, its managed parameters are made
      not to require grad, so autograd does not spend time on the (unused) summed weight
      gradient; the rule then needs only the output gradients;
    * ``needs_output_grads``: capture the gradient of the module's outputs;
    * ``keep_outputs``: keep the (detached) outputs in the record;
    * ``eager``: the module has one output and the rule may run as soon as its gradient arrives
      (inside the backward pass), after which the captured tensors are released;
    * ``shares_input``: calls whose first input is the same tensor (a transformer's query, key and
      value projections) get one :attr:`CallRecord.shared` cache;
    * ``groups_rows``: the rule honours ``record.group`` and returns contributions per example
      (``[B/K, ...]``); any other rule is asked to materialise everything when ``group > 1``, and
      the clipper sums each example's rows itself (exact for every rule, more memory).
    """

    subtree: ClassVar[bool] = False
    toggle_requires_grad: ClassVar[bool] = True
    needs_output_grads: ClassVar[bool] = True
    keep_outputs: ClassVar[bool] = False
    eager: ClassVar[bool] = False
    groups_rows: ClassVar[bool] = False
    shares_input: ClassVar[bool] = False
    #: Parameter names (relative to the module) the rule knows; ``None`` means any.
    param_names: ClassVar[tuple[str, ...] | None] = None

    def specialise(self, module: nn.Module) -> LayerRule:
        """The rule to use for this instance (a rule may hand some configurations to another)."""
        return self

    def problem(self, module: nn.Module) -> str | None:
        """Why this rule cannot handle this instance (``None`` when it can)."""
        return None

    def has_gradient(self, record: CallRecord) -> bool:
        """Whether any gradient reached this call (calls without one contribute nothing)."""
        return record.has_gradient()

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Number of examples in this call; by default the first dimension of the first tensor input."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                if value.dim() == 0:
                    raise ValueError("a scalar input has no example dimension")
                return int(value.shape[0])
        raise ValueError("the call has no tensor input to read the batch size from")

    def forward_context(
        self, module: nn.Module, record: CallRecord
    ) -> contextlib.AbstractContextManager[Any] | None:
        """An optional context entered just before and left just after the module's forward."""
        return None

    def contributions(
        self,
        module: nn.Module,
        record: CallRecord,
        names: Sequence[str],
        materialise: Set[str],
    ) -> dict[str, Contribution]:
        """Per-sample contributions of this call to the parameters ``names`` (relative names).

        Names in ``materialise`` must come back as :class:`Materialised` (they are shared with
        another module or call, and contributions are summed before norms are taken); the rule
        may choose either form for the others.
        """
        raise NotImplementedError


_R = TypeVar("_R", bound=type[LayerRule])
_REGISTRY: dict[type[nn.Module], LayerRule] = {}


def register_rule(module_type: type[nn.Module]) -> Callable[[_R], _R]:
    """Class decorator: use this :class:`LayerRule` for ``module_type`` and its subclasses.

    A subclass that overrides ``forward`` does not inherit the rule (its math may differ) and
    uses the ``torch.func`` fallback instead, which is exact but slower.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_rule expects an nn.Module subclass, got {module_type!r}")

    def decorate(rule_cls: _R) -> _R:
        if not (isinstance(rule_cls, type) and issubclass(rule_cls, LayerRule)):
            raise TypeError(f"register_rule decorates a LayerRule subclass, got {rule_cls!r}")
        _REGISTRY[module_type] = rule_cls()
        return rule_cls

    return decorate


def find_rule(module: nn.Module) -> LayerRule | None:
    """The registered rule for ``module``'s type, walking its MRO, or ``None``.

    An ancestor's rule applies only while the module still uses that ancestor's ``forward``.
    """
    if _DEFERRED:
        _load_deferred(type(module))
    forward = type(module).forward
    for cls in type(module).__mro__:
        rule = _REGISTRY.get(cls)
        if rule is not None:
            return rule if getattr(cls, "forward", None) is forward else None
    return None


def is_floating(t: Tensor) -> bool:
    return torch.is_floating_point(t) or torch.is_complex(t)


#: Rules for an optional library's layers, keyed by the layer's qualified class name: the rule's
#: module (which imports that library) is imported the first time such a layer is seen, so the
#: library is loaded only for models that already use it.
_DEFERRED: dict[str, str] = {"peft.tuners.lora.layer.Linear": "veil.clipping.rules.lora"}


def _load_deferred(module_type: type[nn.Module]) -> None:
    for cls in module_type.__mro__:
        path = _DEFERRED.pop(f"{cls.__module__}.{cls.__qualname__}", None)
        if path is not None:
            importlib.import_module(path)
