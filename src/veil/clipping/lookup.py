"""The rule the clipper uses for a module: its registered rule, else the ``torch.func`` fallback.

Kept apart from :mod:`veil.clipping.registry` (which the fallback imports for the rule interface),
so that neither imports the other back.
"""

from __future__ import annotations

from torch import nn

from veil.clipping.fallback import FunctionalRule
from veil.clipping.registry import LayerRule, find_rule

__all__ = ["rule_for", "rule_problem", "supports"]


def _fallback() -> LayerRule:
    return FunctionalRule()


def rule_for(module: nn.Module) -> LayerRule:
    """The rule the clipper uses for ``module``: its registered rule, else the fallback.

    A registered rule that does not know every trainable parameter the module owns directly
    (a subclass that added one) gives way to the fallback too.
    """
    rule = find_rule(module)
    if rule is not None:
        rule = rule.specialise(module)
    if rule is not None and not rule.subtree and rule.param_names is not None:
        own = {n for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not own <= set(rule.param_names):
            rule = None
    return rule if rule is not None else _fallback()


def rule_problem(module: nn.Module) -> str | None:
    """Why ``module``'s own trainable parameters cannot get exact per-sample gradients, or ``None``."""
    return rule_for(module).problem(module)


def supports(module: nn.Module) -> bool:
    """Whether ``module`` has a rule, or is expected to work with the ``torch.func`` fallback.

    Only ``module`` itself is judged (not its children). The fallback cannot be proven to work
    without running it; at run time it also checks that the recomputed per-example outputs
    match what the batched forward produced, and refuses otherwise.
    """
    return rule_problem(module) is None
