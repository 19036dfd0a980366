"""Per-sample norms: each captured call's per-example contributions, checked, and their squared norms.

A rule gives, for each parameter of its site, either a ghost contribution (the per-example squared
norm, and later a weighted sum without forming per-example gradients) or materialised per-example
gradients. A parameter used by more than one call of a backward pass, augmentation copies a rule
cannot group itself, and privacy units force materialisation, so that the per-example gradient is
summed over every use before its norm is taken (:func:`collect`). The clipped objects are examples
(rows, or groups of ``K`` augmented rows) or privacy units (:func:`examples_and_scale`).
"""

from __future__ import annotations

from collections.abc import Set
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from veil.clipping.registry import Contribution, Ghost, Materialised, RuleError
from veil.clipping.sites import Call, Site, location
from veil.clipping.units import unit_means
from veil.errors import ModelNotSupportedError, Problem

__all__ = [
    "Norms",
    "check_calls",
    "collect",
    "contributions_of",
    "examples_and_scale",
    "per_example",
    "refuse",
    "rows_unknown",
]


def refuse(where: str, reason: str, fix: str) -> ModelNotSupportedError:
    return ModelNotSupportedError([Problem(where, reason, fix)])


def rows_unknown(call: Call) -> bool:
    """Whether the call's rule must materialise per row so that the clipper can sum each group
    (augmentation copies a rule cannot group itself, or privacy units of any size)."""
    return call.units is not None or (call.record.group > 1 and not call.site.rule.groups_rows)


def per_example(call: Call, contributions: dict[str, Contribution]) -> dict[str, Contribution]:
    """A rule's contributions per clipped object.

    Augmentation multiplicity, for a rule that does not group rows itself (it was asked to
    materialise): each example's ``K`` row gradients summed (exact: the example's loss is the
    average of its copies' and autograd's row gradients already carry the 1/K). Privacy units:
    each unit's row gradients weighted by ``1/n_u`` (``n_u`` its rows in the batch) and summed,
    the mean of its rows' gradients up to the loss's own scale (see :func:`examples_and_scale`)."""
    if not rows_unknown(call):
        return contributions
    out: dict[str, Contribution] = {}
    for name, c in contributions.items():
        if not isinstance(c, Materialised):
            raise RuntimeError(f"veil: rule for {location(call.site.name)} ignored materialise={name}")
        grads = c.grads
        if call.units is not None:
            out[name] = Materialised(unit_means(grads, call.units))
        else:
            k = call.record.group
            out[name] = Materialised(grads.reshape(grads.shape[0] // k, k, *grads.shape[1:]).sum(dim=1))
    return out


def check_calls(calls: list[Call], late: bool) -> tuple[int, int]:
    """``(rows, group size)`` of one backward pass's calls, refused unless every call agrees on both."""
    if late or len({c.generation for c in calls}) > 1:
        raise refuse(
            "model",
            "gradients from more than one backward pass were captured before accumulate(), so "
            "examples of different passes cannot be told apart (reentrant activation "
            "checkpointing, which runs a backward inside the backward, does this too)",
            "call accumulate() after each backward, before the next forward; use "
            "checkpoint(..., use_reentrant=False) for activation checkpointing",
        )
    sizes = {c.record.batch_size for c in calls}
    if len(sizes) > 1:
        detail = ", ".join(f"{location(c.site.name)}: {c.record.batch_size}" for c in calls)
        raise refuse(
            "model",
            f"layers saw different numbers of examples in dimension 0 ({detail})",
            "keep the examples in dimension 0 of every layer's input (batch_first), "
            "without reshaping them into other dimensions",
        )
    groups = {c.record.group for c in calls}
    if len(groups) > 1:
        raise refuse(
            "model",
            f"layers of one backward pass were captured with different group sizes {sorted(groups)}",
            "change group_size only between physical batches (after accumulate)",
        )
    return (sizes.pop() if sizes else 0), (groups.pop() if groups else 1)


def examples_and_scale(
    calls: list[Call], rows: int, group: int, loss_reduction: Literal["mean", "sum"]
) -> tuple[int, float]:
    """(clipped objects in the batch, factor turning autograd's gradients into theirs).

    Rows (group 1): ``B`` examples; augmentation multiplicity: ``rows/K`` examples, whose
    summed row gradients times the factor are the gradient of the mean of the example's copies;
    privacy units: ``U`` units, whose row gradients were already weighted by ``1/n_u`` in
    :func:`per_example`, so the factor only undoes the loss's mean over the ``rows``."""
    unit_sets = {id(c.units) for c in calls}
    if len(unit_sets) > 1:
        raise refuse(
            "model",
            "layers of one backward pass were captured with different unit_index tensors",
            "change unit_index only between physical batches (after accumulate)",
        )
    units = calls[0].units if calls else None
    if units is not None:
        count = int(units.max()) + 1 if units.numel() else 0
        return count, float(rows) if loss_reduction == "mean" else 1.0
    batch = rows // group
    # Autograd's gradient of an example's rows, times scale, is the gradient of the example's
    # own loss term (the mean of its K copies' losses).
    return batch, float(batch) if loss_reduction == "mean" else 1.0 / group


def contributions_of(call: Call, shared: set[int]) -> tuple[dict[str, Contribution], Set[str]]:
    """The call's contributions (its rule run now unless it already ran during backward)."""
    site = call.site
    if call.contributions is None and call.error is None:
        forced = {
            n for n, p in zip(site.names, site.params, strict=True) if id(p) in shared or rows_unknown(call)
        }
        try:
            call.contributions = per_example(
                call, site.rule.contributions(site.module, call.record, site.names, forced)
            )
        except RuleError as exc:
            call.error = exc
        call.forced = frozenset(forced)
        call.release()
    if call.error is not None:
        raise refuse(
            f"{location(site.name)} ({type(site.module).__name__})", call.error.reason, call.error.fix
        ) from call.error
    assert call.contributions is not None
    return call.contributions, call.forced


def _check_shape(site: Site, name: str, p: nn.Parameter, c: Contribution, batch: int) -> None:
    got = c.grads.shape if isinstance(c, Materialised) else c.norm_sq.shape
    want = (batch, *p.shape) if isinstance(c, Materialised) else (batch,)
    if tuple(got) != tuple(want):
        raise RuntimeError(
            f"veil: rule {type(site.rule).__name__} gave shape {tuple(got)} for "
            f"{location(site.name)}.{name}, expected {want}"
        )


class Norms(NamedTuple):
    """One batch's per-example squared norms per group, and what the clipped sum is formed from."""

    squares: list[list[Tensor]]
    """Per group: the ``[B]`` squared-norm parts of its parameters (ghost or materialised)."""
    materialised: dict[int, Tensor]
    """id(parameter) → its per-example gradients ``[B, *shape]``, summed over every use."""
    ghosts: list[tuple[int, Ghost]]
    """(id(parameter), ghost contribution) pairs."""


def collect(
    calls: list[Call], batch: int, group_of: dict[int, int], groups: int, norm_dtype: torch.dtype
) -> Norms:
    """Every call's contributions, as squared norms per group (see the module docstring)."""
    uses: dict[int, int] = {}
    for call in calls:
        for p in call.site.params:
            uses[id(p)] = uses.get(id(p), 0) + 1
    shared = {pid for pid, n in uses.items() if n > 1}
    squares: list[list[Tensor]] = [[] for _ in range(groups)]
    materialised: dict[int, Tensor] = {}
    ghosts: list[tuple[int, Ghost]] = []
    for call in calls:
        site = call.site
        contributions, forced = contributions_of(call, shared)
        for name, p in zip(site.names, site.params, strict=True):
            c = contributions.get(name)
            if c is None:
                continue
            _check_shape(site, name, p, c, batch)
            pid = id(p)
            if isinstance(c, Materialised):
                prev = materialised.get(pid)
                materialised[pid] = c.grads if prev is None else prev + c.grads
            elif name in forced or pid in shared:
                raise RuntimeError(f"veil: rule for {location(site.name)} ignored materialise={name}")
            elif c.without is None:
                # Refused whatever the data: the clipper must be able to drop any example whose
                # gradient is not finite (veil.clipping.clipped_sum.finite_examples), so whether a
                # run stops never depends on one record's values.
                raise refuse(
                    f"{location(site.name)} ({type(site.module).__name__})",
                    f"its rule {type(site.rule).__name__} returned a Ghost for {name!r} without `without`, "
                    "so an example whose gradient is not finite could not be dropped from the sum",
                    "give the Ghost a `without` (a function of a [B] keep mask returning the weighted sum "
                    "over the kept examples, the others' operands set to zero; see veil.clipping.Ghost), "
                    "or return Materialised gradients",
                )
            else:
                squares[group_of[pid]].append(c.norm_sq.to(norm_dtype))
                ghosts.append((pid, c))
    for pid, grads in materialised.items():
        norm = torch.linalg.vector_norm(grads.reshape(batch, -1), dim=1, dtype=norm_dtype)
        squares[group_of[pid]].append(norm.square())
    return Norms(squares, materialised, ghosts)
