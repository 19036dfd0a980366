"""Model validator and fixer: find every reason a model cannot be trained with per-example privacy.

DP-SGD protects one example by bounding *its own* gradient (clipping) and hiding it under noise. That
needs (1) each example's output to depend on that example only, (2) every trainable parameter to have
a per-sample clipping rule, and (3) no state updated from private data outside the noisy gradient.

:func:`validate` returns all problems at once (never just the first); :func:`fix` repairs the ones that
have a standard repair and returns a new module, leaving the input untouched.
"""

from __future__ import annotations

import copy

from torch import nn

from veil.errors import Problem

__all__ = ["fix", "validate"]

_BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)
_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _name(prefix: str) -> str:
    return prefix or "<model>"


def validate(model: nn.Module) -> list[Problem]:
    """Every problem that stops ``model`` from being trained with per-example DP; ``[]`` if none.

    Checked, per module:

    * BatchNorm (any dimension, lazy, synchronised) normalises each example with statistics of the
      whole batch, so an example's output and gradient depend on the other examples: clipping one
      example's gradient no longer bounds its influence.
    * Buffers that track batch statistics (``running_mean``/``running_var``, ``track_running_stats``)
      are updated from private data without noise and ship with the model.
    * Modules owning trainable parameters for which :func:`veil.clipping.supports` has neither a
      clipping rule nor a working ``torch.func`` fallback.

    A forward that mixes examples in user code (e.g. ``x - x.mean(0)``) cannot be seen statically;
    :meth:`veil.PrivacyEngine.make_private` probes for it on real batches.
    """
    from veil.clipping import supports

    problems: list[Problem] = []
    for prefix, module in model.named_modules():
        where = _name(prefix)
        kind = type(module).__name__
        if isinstance(module, _BATCH_NORMS):
            problems.append(
                Problem(
                    where,
                    f"{kind} normalises each example with statistics of the whole batch, so one example's "
                    "output depends on the others and clipping no longer bounds its influence",
                    "replace it with GroupNorm (veil.fix(model), or ModuleValidator.fix(model) in "
                    "Opacus-style code, does this, copying the affine parameters)",
                )
            )
            continue  # its running-stat buffers are part of the same fix
        own_buffers = dict(module.named_buffers(recurse=False))
        tracked = [b for b in _STAT_BUFFERS if b in own_buffers]
        if getattr(module, "track_running_stats", False) or tracked:
            listed = ", ".join(tracked) or "running statistics"
            problems.append(
                Problem(
                    where,
                    f"{kind} updates buffers ({listed}) from batch statistics of private data without noise",
                    "stop tracking them (track_running_stats=False; veil.fix(model) does this for norm "
                    "layers) or use a normalisation without batch statistics",
                )
            )
        owns_trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if owns_trainable and not supports(module):
            problems.append(
                Problem(
                    where,
                    f"{kind} owns trainable parameters but has no per-sample clipping rule and the "
                    "torch.func fallback cannot compute its per-sample gradients",
                    "freeze its parameters (requires_grad=False), replace it with supported layers, "
                    "or register a clipping rule for it in veil.clipping",
                )
            )
    return problems


def _group_count(channels: int, max_groups: int = 32) -> int:
    """The largest divisor of ``channels`` that is at most ``max_groups`` (GroupNorm's usual 32)."""
    return max(g for g in range(1, min(channels, max_groups) + 1) if channels % g == 0)


def _replacement(module: nn.Module) -> nn.Module | None:
    """The per-example replacement of one module, or None if it needs none (or has no automatic fix)."""
    if isinstance(module, _BATCH_NORMS):
        channels = getattr(module, "num_features", 0)
        if not isinstance(channels, int) or channels < 1:  # lazy BatchNorm before its first forward
            return None
        bn: nn.modules.batchnorm._NormBase = module  # type: ignore[assignment]
        gn = nn.GroupNorm(_group_count(channels), channels, eps=bn.eps, affine=bn.affine)
        if bn.affine and bn.weight is not None and bn.bias is not None:
            gn.weight.data.copy_(bn.weight.data)
            gn.bias.data.copy_(bn.bias.data)
            gn.weight.requires_grad_(bn.weight.requires_grad)
            gn.bias.requires_grad_(bn.bias.requires_grad)
        p = next(iter(bn.parameters()), None)
        if p is not None:
            gn = gn.to(device=p.device, dtype=p.dtype)
        return gn
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        if not isinstance(module.num_features, int) or module.num_features < 1:
            return None
        inorm = type(module)(
            module.num_features, eps=module.eps, affine=module.affine, track_running_stats=False
        )
        if module.affine and module.weight is not None and module.bias is not None:
            inorm.weight.data.copy_(module.weight.data)
            inorm.bias.data.copy_(module.bias.data)
        p = next(iter(module.parameters()), None)
        return inorm if p is None else inorm.to(device=p.device, dtype=p.dtype)
    return None


def fix(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with the automatic fixes applied; ``model`` itself is not modified.

    BatchNorm{1,2,3}d/SyncBatchNorm → GroupNorm with the largest group count ≤ 32 that divides the
    channels (same ``eps``, affine weight and bias copied); InstanceNorm tracking running statistics →
    the same layer without them. Build the optimizer from the *returned* model's parameters. Problems
    without an automatic fix are left for :func:`validate` to report.
    """
    fixed = copy.deepcopy(model)
    root = _replacement(fixed)
    if root is not None:
        return root
    for _, module in list(fixed.named_modules()):
        for child_name, child in list(module.named_children()):
            new = _replacement(child)
            if new is not None:
                setattr(module, child_name, new)
    return fixed
