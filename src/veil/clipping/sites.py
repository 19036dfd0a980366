"""Site bookkeeping: which modules the clipper hooks, with which rule, and what one forward call captured.

:func:`discover` walks the model once: every module that owns trainable parameters becomes a
:class:`Site` with its rule (:func:`veil.clipping.lookup.rule_for`: the registered rule, else the
``torch.func`` fallback; a subtree rule covers its children). A module whose rule cannot give exact
per-sample gradients is refused, all such modules at once. Each site's parameters belong to one
clipping group (one group per parameter-owning module, for per-layer clipping). :func:`check_bounds`
turns ``max_grad_norm`` into one bound per group (flat: one). A :class:`Call` is one captured forward
call of a site and, once its rule ran, its per-example contributions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from torch import Tensor, nn

from veil.clipping.lookup import rule_for
from veil.clipping.registry import CallRecord, Contribution, LayerRule, RuleError
from veil.errors import InvalidParameterError, ModelNotSupportedError, Problem

__all__ = ["Call", "Discovery", "Site", "check_bounds", "discover", "location"]


@dataclass(eq=False)
class Site:
    """One hooked module: its rule and the trainable parameters it manages."""

    name: str
    module: nn.Module
    rule: LayerRule
    names: list[str]
    params: list[nn.Parameter]
    frames: list[tuple[Call, Any, bool] | None] = field(default_factory=list)


@dataclass(eq=False)
class Call:
    """One captured forward call, and what its rule made of it (when done during backward)."""

    site: Site
    record: CallRecord
    generation: int
    units: Tensor | None = None
    """The unit label of each row (privacy-unit mode), captured with the forward; None otherwise."""
    contributions: dict[str, Contribution] | None = None
    forced: frozenset[str] = frozenset()
    error: RuleError | None = None

    def has_gradient(self) -> bool:
        return (
            self.contributions is not None
            or self.error is not None
            or self.site.rule.has_gradient(self.record)
        )

    def release(self) -> None:
        """Drop the captured tensors (contributions keep what they still need)."""
        self.record.args, self.record.kwargs = (), {}
        self.record.outputs, self.record.grads = [], []
        self.record.extra = None


def location(name: str) -> str:
    return name or "(root module)"


class Discovery(NamedTuple):
    """The sites of a model, its clipping groups, and its clipped parameters."""

    sites: list[Site]
    groups: list[str]
    group_of: dict[int, int]
    """id(parameter) → index of its group in ``groups``."""
    parameters: list[nn.Parameter]
    names: dict[int, str]
    """id(parameter) → its name in the model."""


def discover(root: nn.Module) -> Discovery:
    """Every parameter-owning module of ``root`` as a site with its rule (see the module docstring)."""
    problems: list[Problem] = []
    owner: dict[int, int] = {}  # id(param) -> group index
    covered: set[int] = set()  # modules inside a subtree rule
    groups: list[str] = []
    sites: list[Site] = []
    for name, mod in root.named_modules():
        if id(mod) in covered:
            continue
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
        rule = rule_for(mod)
        if rule.subtree:
            covered.update(id(sub) for sub in mod.modules() if sub is not mod)
            own = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]
        if not own:
            continue
        problem = rule.problem(mod)
        if problem is not None:
            problems.append(
                Problem(
                    f"{location(name)} ({type(mod).__name__})",
                    problem,
                    "replace the layer (veil.fix(model) does so for known ones) or freeze its parameters",
                )
            )
            continue
        site = Site(name, mod, rule, [n for n, _ in own], [p for _, p in own])
        for p in site.params:
            if id(p) not in owner:
                if not groups or groups[-1] != location(name):
                    groups.append(location(name))
                owner[id(p)] = len(groups) - 1
        sites.append(site)
    if problems:
        raise ModelNotSupportedError(problems)
    parameters = [p for p in root.parameters() if p.requires_grad and id(p) in owner]
    names = {id(p): n for n, p in root.named_parameters() if id(p) in owner}
    return Discovery(sites, groups, owner, parameters, names)


def check_bounds(
    max_grad_norm: float | Sequence[float], clipping: Literal["flat", "per_layer"], groups: list[str]
) -> list[float]:
    """One bound per group (per-layer clipping; a single C is split as C/sqrt(K)), or the flat C."""

    def valid(c: Any) -> bool:
        return not isinstance(c, bool) and isinstance(c, (int, float)) and math.isfinite(c) and c > 0

    fix = "pass a finite clipping bound C > 0 (typical: 0.1 to 10)"
    reason = "the clipping bound C is the sensitivity of the clipped sum and must be finite and positive"
    if isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool):
        if not valid(max_grad_norm):
            raise InvalidParameterError("max_grad_norm", max_grad_norm, reason, fix)
        c = float(max_grad_norm)
        if clipping == "flat":
            return [c]
        k = max(len(groups), 1)
        return [c / math.sqrt(k)] * k
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, Sequence)
        or isinstance(max_grad_norm, str)
    ):
        raise InvalidParameterError("max_grad_norm", max_grad_norm, reason, fix)
    bounds = list(max_grad_norm)
    if clipping == "flat":
        raise InvalidParameterError(
            "max_grad_norm",
            max_grad_norm,
            "flat clipping bounds the whole gradient by one C",
            "pass a single float, or clipping='per_layer' for one bound per group",
        )
    if len(bounds) != len(groups) or not all(valid(c) for c in bounds):
        raise InvalidParameterError(
            "max_grad_norm",
            max_grad_norm,
            f"per-layer clipping needs one finite positive bound per group ({len(groups)}: "
            f"{', '.join(groups)})",
            "pass one C_k > 0 per group in PerSampleClipper.groups order, or a single float",
        )
    return [float(c) for c in bounds]
