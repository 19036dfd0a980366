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
  divisor is the batch size, which the clipper multiplies back. An ``ignore_index`` target would
  change that divisor, so such a batch is refused by :class:`RefuseIgnoredTargets` when it is
  collated, before its forward pass and before the step that would use it is accounted.

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

from veil.errors import DataError, InvalidParameterError

__all__ = ["LoopLossGuard", "RefuseIgnoredTargets", "check_criterion"]

# Losses whose "mean" divides by the batch's total class weight / number of non-ignored targets.
_WEIGHTED_MEAN_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)


def check_criterion(criterion: nn.Module | None, reduction: str) -> int | None:
    """Refuse a criterion whose reduction is not a fixed-coefficient sum of per-example terms.

    Returns the ``ignore_index`` that a ``"mean"``-reduced batch must not contain (for
    :class:`RefuseIgnoredTargets`), or None when there is nothing to guard.
    """
    if criterion is None or not isinstance(criterion, _WEIGHTED_MEAN_LOSSES) or reduction != "mean":
        return None
    if getattr(criterion, "weight", None) is not None:
        raise InvalidParameterError(
            "criterion.weight",
            f"{type(criterion).__name__}(weight=..., reduction='mean')",
            "a weighted mean divides by the batch's total class weight, so adding one example "
            "rescales every other example's gradient and the clipped sum moves by more than C",
            "use reduction='sum' (and loss_reduction='sum'): each term w_y·loss_i then depends on its "
            "own example, and the engine divides the noisy sum by the expected batch size",
        )
    ignore = getattr(criterion, "ignore_index", None)
    return int(ignore) if isinstance(ignore, int) else None


class RefuseIgnoredTargets:
    """A collate function that refuses a batch whose targets (field 1) contain ``ignore_index``.

    Wraps the loader's own collate function (picklable, so it runs in workers too). With a
    ``"mean"`` reduction an ignored target changes the divisor of every other example's term;
    refusing the batch as it is collated stops the run before that batch reaches the model, the
    clipper or the accountant. Batches without an integer target tensor in field 1 pass unchecked.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], ignore_index: int) -> None:
        self.collate_fn = collate_fn
        self.ignore_index = ignore_index

    def __call__(self, items: list[Any]) -> Any:
        batch = self.collate_fn(items)
        if isinstance(batch, (list, tuple)) and len(batch) > 1:
            target = batch[1]
            if (
                isinstance(target, torch.Tensor)
                and not target.is_floating_point()
                and bool((target == self.ignore_index).any())
            ):
                raise DataError(
                    "targets",
                    f"ignore_index {self.ignore_index} in a batch",
                    "with reduction='mean' an ignored target changes the loss's divisor, so every "
                    "other example's gradient in the batch would depend on it (unbounded sensitivity)",
                    "use reduction='sum' in the criterion (and loss_reduction='sum'), or drop those rows",
                )
        return batch


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

    def __init__(self, model: nn.Module, reduction: str) -> None:
        import weakref

        from torch.nn.modules.module import register_module_forward_hook

        self.reduction = reduction
        # (id(grad_fn), output_nr) → (grad_fn, shape) of the model's latest outputs
        self._outputs: dict[tuple[int, int], tuple[Any, tuple[int, ...]]] = {}
        self._seeds: list[torch.Tensor] = []  # gradients received by watched loss outputs
        self.checked = 0  # loss calls checked, for tests and logs
        guard = weakref.ref(self)

        def on_model(module: nn.Module, args: Any, output: Any) -> None:
            me = guard()
            if me is not None:
                me._record_output(output)

        def on_any(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            me = guard()
            if me is not None and isinstance(module, nn.modules.loss._Loss):
                me._check_loss(module, args, kwargs, output)

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

    def _check_loss(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
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
