"""The engine's loss contract: the loss is a fixed-coefficient sum of per-example terms.

DP-SGD's sensitivity argument needs example ``i``'s gradient to depend on example ``i`` alone: the
clipper recovers ``g_i`` from the gradient of the reduced loss, clips it to norm ≤ C, and adding
or removing one example may then move the clipped sum by at most C (add/remove-one relation).
A reduction whose *divisor* depends on the batch breaks this: with ``weight=`` and
``reduction="mean"``, ``CrossEntropyLoss``/``NLLLoss`` divide by ``Σ_j w_{y_j}`` over the batch,
and with ``ignore_index`` by the number of targets not ignored, so adding one example rescales
every other example's (unclipped) gradient and the sum moves by several C (measured: 3.4 C).

What :func:`check_criterion` accepts, each exactly per example:

* ``reduction="sum"`` with any ``weight``, ``ignore_index`` or ``label_smoothing``: each term
  ``w_{y_i}·ℓ_i`` (0 for an ignored target) depends on example ``i`` only; the engine divides the
  noisy sum by the *expected* batch size ``B = q·N``, a constant.
* ``reduction="mean"`` without ``weight`` (``label_smoothing`` is per example, so allowed): the
  clipper multiplies the gradients back by the batch's number of rows. PyTorch's mean of a
  ``CrossEntropyLoss``/``NLLLoss`` divides by the number of targets *not* ignored — and, with
  sequence targets, by a padded length set by the longest record — so the divisor depends on the
  other examples. While an engine is attached, every such call (a module whose ``forward`` is the
  base class's, integer targets, grad enabled; traced to the model's output or not) is replaced by
  :func:`fixed_divisor_mean`: the sum of the terms not ignored divided by the rows the clipper
  captured. Each example's term is then the sum of its own targets' losses (an ignored target adds
  0: a zero update, the public rule for that record) whatever the other records hold; with one
  target per example and nothing ignored it equals PyTorch's mean. No batch is refused for a
  target's value: after a private row is read, nothing may stop on one record.

Refused, before anything changes (:class:`~veil.errors.InvalidParameterError`, one message
format): ``reduction="mean"`` with a class ``weight`` on ``CrossEntropyLoss``/``NLLLoss``.
Losses of other types are taken at their ``reduction`` (mean over a fixed number of elements per
example, or sum); their per-element ``weight``/``pos_weight`` are fixed coefficients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from veil.errors import InvalidParameterError

__all__ = ["LoopLossGuard", "check_criterion", "fixed_divisor_mean"]

# Losses whose "mean" divides by the batch's total class weight / number of non-ignored targets.
_WEIGHTED_MEAN_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)


def check_criterion(criterion: nn.Module | None, reduction: str) -> None:
    """Refuse a criterion whose reduction is not a fixed-coefficient sum of per-example terms (a public
    setting, checked before any data is read)."""
    if criterion is None or not isinstance(criterion, _WEIGHTED_MEAN_LOSSES) or reduction != "mean":
        return
    if getattr(criterion, "weight", None) is not None:
        raise InvalidParameterError(
            "criterion.weight",
            f"{type(criterion).__name__}(weight=..., reduction='mean')",
            "a weighted mean divides by the batch's total class weight, so adding one example "
            "rescales every other example's gradient and the clipped sum moves by more than C",
            "use reduction='sum' (and loss_reduction='sum'): each term w_y·loss_i then depends on its "
            "own example, and the engine divides the noisy sum by the expected batch size",
        )


_BASE_FORWARDS = (nn.CrossEntropyLoss.forward, nn.NLLLoss.forward)


def fixed_divisor_mean(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int
) -> torch.Tensor | None:
    """A mean-reduced ``CrossEntropyLoss``/``NLLLoss`` call recomputed with the divisor ``rows``.

    Returns ``Σ ℓ / rows`` over every target element, ``ℓ = 0`` for a target equal to
    ``ignore_index``, where ``rows`` is the number of examples' rows the clipper multiplies back
    (PyTorch divides by the targets not ignored, a function of the other examples, and with padded
    sequences by a length the longest record sets). ``None`` when the call has nothing to fix:
    another loss (a subclass with its own ``forward`` included), another reduction,
    class-probability targets (on which ``ignore_index`` does not act). Computed for every such call,
    not only when a target is ignored: no branch on a record's value.
    """
    import torch.nn.functional as F

    if type(module).forward not in _BASE_FORWARDS or getattr(module, "reduction", None) != "mean":
        return None
    names = ("input", "target")
    values = [*args[:2], *(kwargs[n] for n in names[len(args[:2]) :] if n in kwargs)]
    if len(values) != 2 or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    logits, target = values
    if target.is_floating_point() or target.numel() == 0 or rows <= 0:
        return None
    if isinstance(module, nn.CrossEntropyLoss):
        total = F.cross_entropy(
            logits,
            target,
            ignore_index=module.ignore_index,
            reduction="sum",
            label_smoothing=module.label_smoothing,
        )
    else:
        assert isinstance(module, nn.NLLLoss)
        total = F.nll_loss(logits, target, ignore_index=module.ignore_index, reduction="sum")
    return total / rows


_KEPT_OUTPUTS = 16
"""The most model outputs (of the latest forwards) the guard remembers between two steps."""


class LoopLossGuard:
    """Checks the loss the training loop computes from the private model's output (Opacus's idiom:
    ``loss = criterion(model(x), y); loss.backward(); optimizer.step()``, no ``criterion=`` needed).

    Guarantee (the loss contract above, for a loss written in the loop). Every loss module
    (``torch.nn.modules.loss._Loss``) whose input, positional or keyword, derives from the model's
    output — however many autograd steps lie between — is checked when it is called. It is refused
    (:class:`~veil.errors.InvalidParameterError`) if an op on that path mixes examples
    (:mod:`veil.loss_path`: a softmax or mean over the batch dimension, ``out - out.mean(0)``, a
    row selection, ...; each would make one example's gradient depend on the others, up to n·C), if
    its reduction is not the plan's declared one (``"none"`` included: a per-example loss reduced
    by hand, e.g. a weighted mean ``Σ w_i ℓ_i / Σ w_j``, cannot be checked) or if it is a weighted
    mean (:func:`check_criterion`). The gradient that reaches such a loss's output during
    ``backward()`` must be exactly 1: a factor applied in the loop (``loss * len(batch) / B``,
    ``loss / Σ w``) would rescale every example's gradient by a function of the batch, so adding
    one example could move the clipped sum by many C; :meth:`check` (run by the optimizer at every
    ``step()``, before the step is accounted or any noise drawn) refuses it. A refusal therefore
    always precedes the release of the batch it concerns.

    Not covered: a loss computed without a loss module (``F.cross_entropy`` and hand-written
    reductions) is not seen; pass ``criterion=`` to make_private and call it, or use a loss module,
    for the check to apply. Values reaching the loss without a gradient path (``len(out)``, a mask
    from the detached output) are not seen either (see :mod:`veil.loss_path`). Loss modules applied
    to other tensors are left alone.
    """

    def __init__(
        self, model: nn.Module, reduction: str, rows: Callable[[], int | None] | None = None
    ) -> None:
        import weakref

        from torch.nn.modules.module import register_module_forward_hook

        self.reduction = reduction
        self._rows = rows  # the clipper's rows in flight, for fixed_divisor_mean
        # (id(grad_fn), output_nr) → (grad_fn, shape) of the model's latest outputs
        self._outputs: dict[tuple[int, int], tuple[Any, tuple[int, ...]]] = {}
        self._seeds: list[torch.Tensor] = []  # gradients received by watched loss outputs
        self.checked = 0  # loss calls checked, for tests and logs
        guard = weakref.ref(self)

        def on_model(module: nn.Module, args: Any, output: Any) -> None:
            me = guard()
            if me is not None:
                me._record_output(output)

        def on_any(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            me = guard()
            if me is None or not isinstance(module, nn.modules.loss._Loss):
                return None
            replacement = me._fixed_divisor(module, args, kwargs)
            me._check_loss(module, args, kwargs, output if replacement is None else replacement)
            return replacement

        handles = [
            model.register_forward_hook(on_model),
            register_module_forward_hook(on_any, with_kwargs=True),
        ]

        def remove() -> None:
            for handle in handles:
                handle.remove()

        weakref.finalize(self, remove)

    def _record_output(self, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        from veil.mixing_probe import _tensors

        for t in _tensors(output):
            if t.grad_fn is not None:  # the node is kept so that its id is not reused meanwhile
                self._outputs[(id(t.grad_fn), t.output_nr)] = (t.grad_fn, tuple(t.shape))
        while len(self._outputs) > _KEPT_OUTPUTS:  # forwards without a step (e.g. evaluation with
            del self._outputs[next(iter(self._outputs))]  # grad enabled) must not keep graphs alive

    def _fixed_divisor(self, module: nn.Module, args: Any, kwargs: Any) -> torch.Tensor | None:
        """:func:`fixed_divisor_mean` for any loss call while the clipper has rows in flight, whether
        or not its input traces to the model's own output (a submodule's output, a loss inside
        ``forward``): a mean cross-entropy with a batch-dependent divisor is never left in place."""
        if self._rows is None or not torch.is_grad_enabled():
            return None
        rows = self._rows()
        return None if rows is None else fixed_divisor_mean(module, args, kwargs, rows)

    def _check_loss(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Check one loss call on the model's output (``output``: what the loop will receive)."""
        from veil.loss_path import trace_to_outputs

        if not self._outputs:
            return
        sources = {key: shape for key, (_, shape) in self._outputs.items()}
        verdicts = [trace_to_outputs(t, sources) for t in (*args, *kwargs.values())]
        if not any(v.derived for v in verdicts):
            return
        self.checked += 1
        problem = next((v.problem for v in verdicts if v.problem is not None), None)
        if problem is not None:
            raise InvalidParameterError(
                f"{type(module).__name__} input",
                problem,
                "the ops between the model's output and the loss module mix examples (a softmax or "
                "mean over the batch dimension, a row selection, ...), so one example's gradient "
                "depends on the others and adding one example could move the clipped sum by many C",
                "compute the loss row by row with a loss module (ops along dimensions other than 0 "
                "only), or pass criterion= to make_private and call it on the model's output",
            )
        reduction = getattr(module, "reduction", None)
        if reduction != self.reduction:
            raise InvalidParameterError(
                "loss.reduction",
                f"{type(module).__name__}(reduction={reduction!r})",
                f"the engine recovers each example's gradient for a loss reduced by {self.reduction!r}; "
                "any other reduction (or one written in the loop) scales every example's gradient by a "
                "function of the batch, so one example could move the clipped sum by more than C",
                f"use reduction={self.reduction!r} in the loss module (or pass loss_reduction= to "
                "make_private to match it), and no per-example weighting or factor in the loop",
            )
        check_criterion(module, reduction)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._seeds.append)

    def check(self) -> None:
        """Refuse the step if a watched loss was multiplied by anything before ``backward()``."""
        seeds, self._seeds = self._seeds, []
        self._outputs.clear()
        for seed in seeds:
            value = float(seed.detach().double().reshape(-1)[0]) if seed.numel() == 1 else float("nan")
            if not abs(value - 1.0) <= 1e-6:
                raise InvalidParameterError(
                    "loss",
                    "a loss multiplied before backward()" if value == value else "an unreduced loss",
                    "a factor on the loss written in the training loop (such as len(batch)/B or "
                    "1/Σ weights) rescales every example's gradient by a function of the batch, so "
                    "adding one example could move the clipped sum by more than C",
                    "call backward() on the loss module's output itself; the engine already divides "
                    "by the expected batch size (fold a constant factor into the learning rate)",
                )
