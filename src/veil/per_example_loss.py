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

__all__ = ["RefuseIgnoredTargets", "check_criterion"]

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
