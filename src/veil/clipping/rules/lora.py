"""Rule for peft's LoRA ``Linear`` layer: both low-rank factors of an adapter at one hook.

peft computes ``y = base(x) + s · B(A(drop(x)))`` (``s`` = ``lora_alpha / r``; ``base`` frozen).
For one example with positions ``t`` the per-sample gradients of the factors are

* ``∂/∂B = s Σ_t g_t h_tᵀ`` (``p × r``), where ``h_t = A drop(x_t)`` and ``g_t`` is the gradient
  of the loss with respect to ``y_t``;
* ``∂/∂A = Σ_t (s Bᵀ g_t) drop(x_t)ᵀ`` (``r × d``);
* ``∂/∂b_B = s Σ_t g_t`` when the adapter has a bias (``lora_bias=True``).

Each factor is a linear map with a sequence input, so its squared norm and the clipped sum come
from :func:`~veil.clipping._linear_algebra.grouped_linear`: ghost (``O(T²)`` per example, no
per-sample gradient formed) or materialised (``B·r·(d+p)`` numbers), whichever is cheaper for the
call's shape. ``drop(x)`` and ``h`` are captured from the ``lora_A`` call itself, so the dropout
mask that example actually drew is the one used: exact with ``lora_dropout > 0``.

Cost. One hook per adapted layer instead of one per factor, and the frozen base weight is never
touched: its summed gradient is not computed (it does not require grad) and no per-sample work
is done for it. Only vanilla LoRA is handled here; a layer with a variant (DoRA), a trainable
base weight or a factor that is not a plain ``nn.Linear`` is handed back to the per-module rules
(its ``lora_A``/``lora_B`` children then use the linear rule, and anything else the exact
``torch.func`` fallback).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence, Set
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import Tensor, nn

from veil.clipping._linear_algebra import grouped_linear, summed_positions
from veil.clipping.fallback import FunctionalRule
from veil.clipping.registry import (
    CallRecord,
    Contribution,
    LayerRule,
    Materialised,
    RuleError,
    register_rule,
)
from veil.clipping.rules._common import output_grad

_FACTOR = re.compile(r"^lora_(A\.[^.]+\.weight|B\.[^.]+\.(weight|bias))$")


def _vanilla(module: LoraLinear) -> bool:
    """Whether every trainable parameter is a factor of a plain-``Linear`` adapter without a variant."""
    if getattr(module, "lora_variant", None):
        return False
    for name, p in module.named_parameters():
        if p.requires_grad and not _FACTOR.match(name):
            return False
    for adapter, lora_a in module.lora_A.items():
        lora_b = module.lora_B[adapter] if adapter in module.lora_B else None  # noqa: SIM401
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return False
    return True


@register_rule(LoraLinear)
class LoraLinearRule(LayerRule):
    """Per-sample gradients of the LoRA factors of peft's ``lora.Linear`` (see the module docstring)."""

    subtree = True
    eager = True

    def specialise(self, module: nn.Module) -> LayerRule:
        assert isinstance(module, LoraLinear)
        # The fallback owns no parameter of this module directly, so its children get their own rules.
        return self if _vanilla(module) else FunctionalRule()

    def forward_context(
        self, module: nn.Module, record: CallRecord
    ) -> contextlib.AbstractContextManager[Any] | None:
        assert isinstance(module, LoraLinear)
        return _capture_factors(module, record)

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, LoraLinear)
        g = output_grad(record)
        captured: dict[str, list[tuple[Tensor, Tensor]]] = record.extra or {}
        if g is None or not captured:
            return {}
        batch = record.batch_size
        out: dict[str, Contribution] = {}
        for adapter, calls in captured.items():
            a_name, b_name, bias_name = (
                f"lora_A.{adapter}.weight",
                f"lora_B.{adapter}.weight",
                f"lora_B.{adapter}.bias",
            )
            if not any(n in names for n in (a_name, b_name, bias_name)):
                continue
            if len(calls) != 1:
                raise RuleError(
                    f"adapter '{adapter}' ran {len(calls)} times in one forward of the layer",
                    "call each LoRA layer's adapter once per forward, or freeze it",
                )
            x, h = calls[0]
            lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
            assert isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)
            p, r, d = lora_b.out_features, lora_b.in_features, x.shape[-1]
            if (
                g.shape[0] != batch
                or x.shape[0] != batch
                or g.numel() // (batch * p) != x.numel() // (batch * d)
            ):
                raise RuleError(
                    "the adapter's input and the layer's output do not have the same examples and positions",
                    "feed the layer a batch with the examples in dimension 0",
                )
            # the scaling s multiplies the narrow tensors (h, B), never the wide output gradient
            dtype = torch.promote_types(g.dtype, lora_b.weight.dtype)
            scale = float(module.scaling[adapter])
            gb = g.reshape(batch, 1, -1, p).to(dtype)
            if b_name in names:
                out[b_name] = grouped_linear(
                    h.reshape(batch, 1, -1, r) * scale,
                    gb,
                    lora_b.weight.shape,
                    materialise=b_name in materialise,
                )
            if bias_name in names:
                out[bias_name] = Materialised(summed_positions(gb, batch, p).grads * scale)
            if a_name in names:
                g_h = gb @ (lora_b.weight.detach().to(dtype) * scale)
                out[a_name] = grouped_linear(
                    x.reshape(batch, 1, -1, d), g_h, lora_a.weight.shape, materialise=a_name in materialise
                )
        return out


@contextlib.contextmanager
def _capture_factors(module: LoraLinear, record: CallRecord) -> Iterator[None]:
    """While the layer runs forward, keep each ``lora_A`` call's (dropped-out) input and output."""
    captured: dict[str, list[tuple[Tensor, Tensor]]] = {}
    record.extra = captured

    def keeper(adapter: str) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            captured.setdefault(adapter, []).append((args[0].detach(), output.detach()))

        return hook

    handles = [lora_a.register_forward_hook(keeper(adapter)) for adapter, lora_a in module.lora_A.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
