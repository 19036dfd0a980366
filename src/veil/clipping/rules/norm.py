"""Rules for the affine parameters of LayerNorm, RMSNorm, GroupNorm and InstanceNorm1d/2d.

Each normalises within one example, ``y = x̂ ⊙ w + b``, so example ``i``'s gradients are
``Σ (g ⊙ x̂)`` and ``Σ g`` over the positions that share a weight entry. ``x̂`` is recomputed
from the captured input with the module's own settings; the per-sample gradients are small
(one vector per example) and are materialised. The recomputed ``x̂`` is the rule's own tensor, so
``g ⊙ x̂`` is written over it (:func:`_product`): the same products, without a second
activation-sized buffer per call (13 a MiniLM step).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from veil.clipping.registry import CallRecord, Contribution, LayerRule, Materialised, register_rule
from veil.clipping.rules._common import batched_input, output_grad


def _product(g: Tensor, xhat: Tensor) -> Tensor:
    """``g ⊙ x̂``, written over ``x̂`` (the rule's own recomputed tensor, read nowhere else) where that
    gives the same tensor as ``g * xhat``: same shape, and ``x̂``'s dtype is the product's (under
    autocast the two can differ; then a new tensor). Multiplication commutes exactly, so the values
    are the same bit for bit."""
    if g.shape == xhat.shape and torch.result_type(g, xhat) == xhat.dtype:
        return xhat.mul_(g)
    return g * xhat


def _trailing(
    xhat: Tensor, g: Tensor, batch: int, shape: tuple[int, ...], names: Sequence[str]
) -> dict[str, Contribution]:
    """Gradients of a weight/bias of ``shape`` broadcast over the trailing dimensions (``xhat``
    is consumed: see :func:`_product`)."""
    out: dict[str, Contribution] = {}
    if "weight" in names:
        out["weight"] = Materialised(_product(g, xhat).reshape(batch, -1, *shape).sum(dim=1))
    if "bias" in names:
        out["bias"] = Materialised(g.reshape(batch, -1, *shape).sum(dim=1))
    return out


def _channels(
    xhat: Tensor, g: Tensor, batch: int, channels: int, names: Sequence[str]
) -> dict[str, Contribution]:
    """Gradients of a per-channel weight/bias on ``[B, C, *spatial]`` (``xhat`` is consumed: see
    :func:`_product`)."""
    out: dict[str, Contribution] = {}
    if "weight" in names:
        out["weight"] = Materialised(_product(g, xhat).reshape(batch, channels, -1).sum(dim=2))
    if "bias" in names:
        out["bias"] = Materialised(g.reshape(batch, channels, -1).sum(dim=2))
    return out


class _NormRule(LayerRule):
    eager = True
    param_names: ClassVar[tuple[str, ...] | None] = ("weight", "bias")
    min_dim = 2

    def batch_size(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int(batched_input(args, kwargs, self.min_dim, type(module).__name__).shape[0])

    def normalised(self, module: nn.Module, x: Tensor) -> Tensor:
        """``x̂``: a new tensor, which :meth:`split` may write over."""
        raise NotImplementedError

    def split(
        self, module: nn.Module, xhat: Tensor, g: Tensor, batch: int, names: Sequence[str]
    ) -> dict[str, Contribution]:
        raise NotImplementedError

    def contributions(
        self, module: nn.Module, record: CallRecord, names: Sequence[str], materialise: Set[str]
    ) -> dict[str, Contribution]:
        g = output_grad(record)
        if g is None:
            return {}
        x = batched_input(record.args, record.kwargs, self.min_dim, type(module).__name__)
        # x itself only where no weight gradient is asked for: split then never writes over it
        xhat = self.normalised(module, x) if "weight" in names else x
        return self.split(module, xhat, g, record.batch_size, names)


@register_rule(nn.LayerNorm)
class LayerNormRule(_NormRule):
    """``nn.LayerNorm`` with ``elementwise_affine=True`` (with or without bias)."""

    def normalised(self, module: nn.Module, x: Tensor) -> Tensor:
        assert isinstance(module, nn.LayerNorm)
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)

    def split(
        self, module: nn.Module, xhat: Tensor, g: Tensor, batch: int, names: Sequence[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.LayerNorm)
        return _trailing(xhat, g, batch, tuple(module.normalized_shape), names)


@register_rule(nn.GroupNorm)
class GroupNormRule(_NormRule):
    """``nn.GroupNorm`` with ``affine=True`` on ``[B, C, *]``."""

    def normalised(self, module: nn.Module, x: Tensor) -> Tensor:
        assert isinstance(module, nn.GroupNorm)
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def split(
        self, module: nn.Module, xhat: Tensor, g: Tensor, batch: int, names: Sequence[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.GroupNorm)
        return _channels(xhat, g, batch, module.num_channels, names)


class _InstanceNormRule(_NormRule):
    def normalised(self, module: nn.Module, x: Tensor) -> Tensor:
        assert isinstance(module, nn.modules.instancenorm._InstanceNorm)
        if module.training or not module.track_running_stats:
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        return F.instance_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)

    def split(
        self, module: nn.Module, xhat: Tensor, g: Tensor, batch: int, names: Sequence[str]
    ) -> dict[str, Contribution]:
        assert isinstance(module, nn.modules.instancenorm._InstanceNorm)
        return _channels(xhat, g, batch, module.num_features, names)


@register_rule(nn.InstanceNorm1d)
class InstanceNorm1dRule(_InstanceNormRule):
    """``nn.InstanceNorm1d`` with ``affine=True`` on batched ``[B, C, L]`` inputs."""

    min_dim = 3


@register_rule(nn.InstanceNorm2d)
class InstanceNorm2dRule(_InstanceNormRule):
    """``nn.InstanceNorm2d`` with ``affine=True`` on batched ``[B, C, H, W]`` inputs."""

    min_dim = 4


if hasattr(nn, "RMSNorm"):

    @register_rule(nn.RMSNorm)
    class RMSNormRule(_NormRule):
        """``torch.nn.RMSNorm`` with ``elementwise_affine=True``."""

        param_names = ("weight",)

        def normalised(self, module: nn.Module, x: Tensor) -> Tensor:
            assert isinstance(module, nn.RMSNorm)
            return F.rms_norm(x, module.normalized_shape, None, module.eps)

        def split(
            self, module: nn.Module, xhat: Tensor, g: Tensor, batch: int, names: Sequence[str]
        ) -> dict[str, Contribution]:
            assert isinstance(module, nn.RMSNorm)
            return _trailing(xhat, g, batch, tuple(module.normalized_shape), names)
