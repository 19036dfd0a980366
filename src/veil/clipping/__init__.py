"""Exact per-sample gradient clipping for DP-SGD.

:class:`PerSampleClipper` hooks a model, and after each ``loss.backward()`` turns the captured
activations and output gradients into per-example gradient norms and the sum of clipped
per-example gradients, in the same backward pass. One rule per layer type
(:func:`register_rule`, subclass-aware) chooses ghost norms or materialised per-sample
gradients by cost; any other module that owns parameters uses an exact ``torch.func`` fallback.
"""

from __future__ import annotations

from veil.clipping import rules as _rules  # noqa: F401  (registers the built-in rules)
from veil.clipping.clipper import ClippingMode, LossReduction, PerSampleClipper
from veil.clipping.lookup import supports
from veil.clipping.registry import (
    CallRecord,
    Contribution,
    Ghost,
    LayerRule,
    Materialised,
    RuleError,
    register_rule,
)

__all__ = [
    "CallRecord",
    "ClippingMode",
    "Contribution",
    "Ghost",
    "LayerRule",
    "LossReduction",
    "Materialised",
    "PerSampleClipper",
    "RuleError",
    "register_rule",
    "supports",
]
