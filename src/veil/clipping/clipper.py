"""Per-sample clipping: per-example gradient norms and the clipped sum, in one backward pass.

Guarantee. After ``loss.backward()`` on a physical batch, :meth:`PerSampleClipper.accumulate`
adds ``Σ_i clip(g_i)`` to the accumulator, where ``g_i`` is the gradient of example ``i``'s own
loss term with respect to every trainable parameter and ``clip`` scales ``g_i`` to norm at most
``C`` (flat), or each group's part to at most ``C_k`` (per-layer). Adding or removing one
example therefore changes the accumulated sum by a vector of L2 norm at most
:attr:`PerSampleClipper.sensitivity` (``C``, or ``sqrt(Σ C_k²)``): the add/remove-one
neighbouring relation used by the DP-SGD accountant. With augmentation multiplicity
(:attr:`PerSampleClipper.group_size` ``K > 1``) an example is its ``K`` consecutive rows, ``g_i`` the
gradient of the mean of their loss terms, and the same bound holds per example. With a privacy
unit (:attr:`PerSampleClipper.unit_index`, a unit label per row, groups of any size) the clipped
object is the *unit*: ``g_u`` is the mean of the per-row gradients of unit ``u``'s rows in the
batch, clipped once, so adding or removing one unit with all its rows moves the sum by at most the
same sensitivity (add/remove-one-unit neighbouring; :mod:`veil.units`).

Assumptions, each checked where it can be: examples lie along dimension 0 of the inputs of
every hooked module (a batch-size mismatch between layers is refused); the model's forward does
not mix examples (the engine's validator checks this; the fallback refuses a module whose
per-example recomputation differs); the loss is the mean (``loss_reduction="mean"``) or sum of
per-example terms; every trainable parameter is used only inside the forward of a module that
owns it (a parameter that received gradient any other way is refused, since its per-example
gradient was not observed).

How. Forward hooks keep each parameter-owning module's inputs; tensor hooks on its outputs
receive the output gradients during the user's backward. While a module runs forward its
parameters are made not to require grad, so autograd does not also compute the summed
(non-private) weight gradient, which would be discarded. Each layer rule then gives per-sample
squared norms, ghost (without forming per-sample gradients) or materialised, whichever is
cheaper; rules that allow it do this inside the backward pass as each output gradient arrives,
so a layer's activations and output gradient can be freed early when its per-sample gradients
are smaller. Once every norm is known, the clip factors are applied inside the sum itself
(book-keeping: ``Σ_i c_i g_i`` as one weighted matmul), with no second backward pass.

Low precision (bfloat16/float16 parameters). Norms, clip factors and the weighted sums are
computed at float32 (the rules upcast their inputs; factors are never cast down), the factors are
scaled by ``1 - 2u`` (``u`` the unit roundoff of the coarsest parameter dtype: 2⁻⁸ for bfloat16,
2⁻¹¹ for float16, negligible for float32/64), and the sum is accumulated at float32. So each
example's contribution ``c_i g_i``, even rounded once to the parameter's dtype, has norm ≤ C:
rounding cannot push it over the bound the accountant assumes (a test checks this in bf16 and fp16
for ghost, sequence and convolution paths). The price is a 0.8 % (bf16) smaller step, no privacy.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from veil.clipping._autograd import reattach
from veil.clipping._tree import flatten, map_tensors
from veil.clipping.lookup import rule_for
from veil.clipping.registry import (
    CallRecord,
    Contribution,
    Ghost,
    LayerRule,
    Materialised,
    RuleError,
    is_floating,
)
from veil.clipping.units import check_unit_index, unit_means
from veil.errors import InvalidParameterError, ModelNotSupportedError, Problem

__all__ = ["ClippingMode", "LossReduction", "PerSampleClipper"]

ClippingMode = Literal["flat", "per_layer"]
LossReduction = Literal["mean", "sum"]

_STABILITY = 1e-12
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, PerSampleClipper] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class _Site:
    """One hooked module: its rule and the trainable parameters it manages."""

    name: str
    module: nn.Module
    rule: LayerRule
    names: list[str]
    params: list[nn.Parameter]
    frames: list[tuple[_Call, Any, bool] | None] = field(default_factory=list)


@dataclass(eq=False)
class _Call:
    """One captured forward call, and what its rule made of it (when done during backward)."""

    site: _Site
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


def _location(name: str) -> str:
    return name or "(root module)"


class PerSampleClipper:
    """Exact per-sample clipping for every trainable parameter of ``module``.

    ``max_grad_norm``: one ``C`` for flat clipping; for ``clipping="per_layer"`` either one
    ``C_k`` per group (one group per parameter-owning module, in :attr:`groups` order) or a
    single ``C`` split as ``C/sqrt(K)`` per group. ``loss_reduction`` says how the loss combines
    the per-example terms of a physical batch: ``"mean"`` (autograd's gradients are then
    ``1/B`` times the sum, so they are multiplied back by ``B``) or ``"sum"``.

    Hooks are owned by this object (nothing is patched onto parameters or modules); a module can
    be attached to one clipper at a time; :meth:`remove` detaches them. Use: forward, backward,
    :meth:`accumulate`, for each physical batch; a second backward pass before
    :meth:`accumulate` is refused (its examples would be mixed with the first one's).
    """

    parameters: list[nn.Parameter]
    groups: list[str]

    def __init__(
        self,
        module: nn.Module,
        max_grad_norm: float | Sequence[float],
        *,
        clipping: ClippingMode = "flat",
        loss_reduction: LossReduction = "mean",
    ) -> None:
        if clipping not in ("flat", "per_layer"):
            raise InvalidParameterError(
                "clipping", clipping, "the clipping mode decides the sensitivity", "use 'flat' or 'per_layer'"
            )
        if loss_reduction not in ("mean", "sum"):
            raise InvalidParameterError(
                "loss_reduction",
                loss_reduction,
                "each example's own gradient is recovered only from a mean or a sum of per-example losses",
                "use 'mean' or 'sum' and reduce the loss that way",
            )
        self.module = module
        self.clipping: ClippingMode = clipping
        self.loss_reduction: LossReduction = loss_reduction
        self._sites: list[_Site] = []
        self._handles: list[RemovableHandle] = []
        self._calls: list[_Call] = []
        self._generation = 0
        self._backward_seen = False
        self._late = False
        self._uses: dict[int, dict[int, int]] = {}  # generation -> id(param) -> forward calls
        self._toggled: dict[int, tuple[nn.Parameter, int, bool]] = {}  # id -> (param, depth, before)
        self._suspended = False
        self._sum: list[Tensor] | None = None
        self._group = 1
        self._units: Tensor | None = None
        self._discover(module)
        self._bounds = self._check_bounds(max_grad_norm)
        self._attach()

    # ------------------------------------------------------------------ setup
    def _discover(self, root: nn.Module) -> None:
        problems: list[Problem] = []
        owner: dict[int, int] = {}  # id(param) -> group index
        covered: set[int] = set()  # modules inside a subtree rule
        self.groups = []
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
                        f"{_location(name)} ({type(mod).__name__})",
                        problem,
                        "replace the layer (veil.fix(model) does so for known ones) or freeze its parameters",
                    )
                )
                continue
            site = _Site(name, mod, rule, [n for n, _ in own], [p for _, p in own])
            for p in site.params:
                if id(p) not in owner:
                    if not self.groups or self.groups[-1] != _location(name):
                        self.groups.append(_location(name))
                    owner[id(p)] = len(self.groups) - 1
            self._sites.append(site)
        if problems:
            raise ModelNotSupportedError(problems)
        self._group_of = owner
        self.parameters = [p for p in root.parameters() if p.requires_grad and id(p) in owner]
        self._names = {id(p): n for n, p in root.named_parameters() if id(p) in owner}

    def _check_bounds(self, max_grad_norm: float | Sequence[float]) -> list[float]:
        def valid(c: Any) -> bool:
            return not isinstance(c, bool) and isinstance(c, (int, float)) and math.isfinite(c) and c > 0

        fix = "pass a finite clipping bound C > 0 (typical: 0.1 to 10)"
        reason = "the clipping bound C is the sensitivity of the clipped sum and must be finite and positive"
        if isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool):
            if not valid(max_grad_norm):
                raise InvalidParameterError("max_grad_norm", max_grad_norm, reason, fix)
            c = float(max_grad_norm)
            if self.clipping == "flat":
                return [c]
            k = max(len(self.groups), 1)
            return [c / math.sqrt(k)] * k
        if (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, Sequence)
            or isinstance(max_grad_norm, str)
        ):
            raise InvalidParameterError("max_grad_norm", max_grad_norm, reason, fix)
        bounds = list(max_grad_norm)
        if self.clipping == "flat":
            raise InvalidParameterError(
                "max_grad_norm",
                max_grad_norm,
                "flat clipping bounds the whole gradient by one C",
                "pass a single float, or clipping='per_layer' for one bound per group",
            )
        if len(bounds) != len(self.groups) or not all(valid(c) for c in bounds):
            raise InvalidParameterError(
                "max_grad_norm",
                max_grad_norm,
                f"per-layer clipping needs one finite positive bound per group ({len(self.groups)}: "
                f"{', '.join(self.groups)})",
                "pass one C_k > 0 per group in PerSampleClipper.groups order, or a single float",
            )
        return [float(c) for c in bounds]

    def _attach(self) -> None:
        for site in self._sites:
            other = _ATTACHED.get(site.module)
            if other is not None and other is not self:
                self.remove()
                raise InvalidParameterError(
                    "module",
                    _location(site.name),
                    "it is already hooked by another PerSampleClipper, whose hooks would interfere",
                    "call remove() on the previous clipper (or its engine) first",
                )
            _ATTACHED[site.module] = self
            self._handles.append(
                site.module.register_forward_pre_hook(self._pre_hook(site), with_kwargs=True)
            )
            self._handles.append(
                site.module.register_forward_hook(self._post_hook(site), with_kwargs=True, always_call=True)
            )

    @property
    def group_size(self) -> int:
        """Rows per example (augmentation multiplicity K; 1 by default).

        With ``K > 1`` every batch the model sees holds ``B·K`` rows, rows ``i·K .. i·K + K − 1``
        being the ``K`` augmented copies of example ``i``, and the loss averages each example's
        copies (the mean over all rows, or the sum divided by ``K``). Example ``i``'s gradient is then
        ``(1/K) Σ_k ∇ℓ(a_k(x_i))`` and *that* is clipped: one vector of norm ≤ ``C`` per example, so
        :attr:`sensitivity` is unchanged (De et al. 2022). :meth:`accumulate` returns ``B`` norms.
        Set it between physical batches (a forward already captured keeps its own).
        """
        return self._group

    @group_size.setter
    def group_size(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidParameterError(
                "group_size",
                k,
                "it counts the augmented copies of each example and must be an integer ≥ 1",
                "pass K ≥ 1 (1: no augmentation multiplicity)",
            )
        if k > 1 and self._units is not None:
            raise InvalidParameterError(
                "group_size", k, "rows are already grouped by privacy unit", "use one grouping at a time"
            )
        self._group = k

    @property
    def unit_index(self) -> Tensor | None:
        """The privacy unit of each row of the next physical batch (``[R]`` labels ``0..U−1``), or None.

        With it set, the clipped object is the unit, not the row: unit ``u``'s gradient is the *mean*
        of the per-row gradients of its rows in the batch, ``g_u = (1/n_u) Σ_{r∈u} ∇ℓ_r``, and that
        vector is clipped once to ``C``. :meth:`accumulate` then returns ``U = max label + 1`` norms
        (a label with no row contributes a zero vector). Rows of a unit need not be consecutive and
        units may have different numbers of rows; the loss is the ordinary mean (or sum) over rows.
        Every layer materialises per-row gradients in this mode (ghost norms cannot see unit
        boundaries), which costs memory, never privacy. Set it before each forward (the engine's
        loader does); a forward already captured keeps its own.
        """
        return self._units

    @unit_index.setter
    def unit_index(self, units: Tensor | None) -> None:
        if units is not None:
            check_unit_index(units)
            if self._group > 1:
                raise InvalidParameterError(
                    "unit_index",
                    "set with group_size > 1",
                    "rows are already grouped by augmentation multiplicity",
                    "use one grouping at a time",
                )
        self._units = units

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, site: _Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._suspended or not torch.is_grad_enabled():
                site.frames.append(None)
                return
            try:
                batch = site.rule.batch_size(module, args, kwargs)
            except ValueError as exc:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{_location(site.name)} ({type(module).__name__})",
                            str(exc),
                            "feed batches with the examples in dimension 0",
                        )
                    ]
                ) from exc
            units = self._units
            if units is not None and units.numel() != batch:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{_location(site.name)} ({type(module).__name__})",
                            f"it saw {batch} rows but unit_index names {units.numel()}, so rows cannot be "
                            "assigned to their privacy units",
                            "set clipper.unit_index to one label per row of the batch (the engine's "
                            "loader does this)",
                        )
                    ]
                )
            if batch % self._group:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{_location(site.name)} ({type(module).__name__})",
                            f"it saw {batch} rows, not a whole number of groups of {self._group} "
                            "augmented copies, so rows cannot be assigned to their examples",
                            "feed each example's K copies as K consecutive rows (veil.augment.multiplicity)",
                        )
                    ]
                )
            if self._backward_seen:  # a forward after a backward starts a new generation
                self._generation += 1
                self._backward_seen = False
            uses = self._uses.setdefault(self._generation, {})
            for p in site.params:
                uses[id(p)] = uses.get(id(p), 0) + 1
            record = CallRecord(
                args=_detached(args),
                kwargs=_detached(kwargs) if kwargs else {},
                batch_size=batch,
                autocast=_autocast_state(args, kwargs),
                group=self._group,
            )
            call = _Call(site, record, self._generation, units=units)
            context = site.rule.forward_context(module, record)
            toggled = site.rule.toggle_requires_grad
            if toggled:
                for p in site.params:
                    _, count, before = self._toggled.get(id(p), (p, 0, p.requires_grad))
                    if count == 0:
                        p.requires_grad_(False)
                    self._toggled[id(p)] = (p, count + 1, before)
            if context is not None:
                context.__enter__()
            site.frames.append((call, context, toggled))

        return hook

    def _release(self, site: _Site, frame: tuple[_Call, Any, bool]) -> None:
        _, context, toggled = frame
        if context is not None:
            context.__exit__(None, None, None)
        if toggled:
            for p in site.params:
                param, count, before = self._toggled[id(p)]
                if count == 1:
                    del self._toggled[id(p)]
                    param.requires_grad_(before)
                else:
                    self._toggled[id(p)] = (param, count - 1, before)

    def _post_hook(self, site: _Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            frame = site.frames.pop() if site.frames else None
            if frame is None:
                return None
            self._release(site, frame)
            call = frame[0]
            self._calls.append(call)
            if not site.rule.needs_output_grads:
                return None
            if isinstance(output, Tensor):  # the common case, without the tree walk
                if not is_floating(output):
                    return None
                out = output if output.requires_grad else reattach(output, _owned(module, call.record))
                self._watch(call, out)
                return None if out is output else out
            leaves, build = flatten(output)
            changed = False
            for i, leaf in enumerate(leaves):
                if not (isinstance(leaf, Tensor) and is_floating(leaf)):
                    continue
                if not leaf.requires_grad:
                    leaf = reattach(leaf, [*_owned(module, call.record), *leaves[:i]])
                    leaves[i] = leaf
                    changed = True
                self._watch(call, leaf)
            return build(leaves) if changed else None

        return hook

    def _watch(self, call: _Call, out: Tensor) -> None:
        """Receive the gradient of ``out`` (a module output) during backward."""
        record = call.record
        slot = len(record.grads)
        record.grads.append(None)
        if call.site.rule.keep_outputs:
            record.outputs.append(out.detach())
        single = slot == 0 and call.site.rule.eager and record.batch_size > 0

        def sink(grad: Tensor) -> None:
            self._backward_seen = True
            if call.contributions is not None or call.error is not None or record.grads[slot] is not None:
                self._late = True  # a second backward through the same forward
                return
            record.grads[slot] = grad
            if single and len(record.grads) == 1:
                self._process_now(call)

        out.register_hook(sink)

    def _process_now(self, call: _Call) -> None:
        """Run the call's rule inside backward, so its inputs and output gradient can be freed."""
        site = call.site
        uses = self._uses.get(call.generation, {})
        call.forced = frozenset(
            n
            for n, p in zip(site.names, site.params, strict=True)
            if uses.get(id(p), 0) > 1 or _rows_unknown(call)
        )
        try:
            with torch.no_grad():
                call.contributions = _per_example(
                    call, site.rule.contributions(site.module, call.record, site.names, call.forced)
                )
        except RuleError as exc:
            call.error = exc
        call.release()

    # ------------------------------------------------------------------ clipping
    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under add/remove-one: ``C`` or ``sqrt(Σ C_k²)``."""
        return math.sqrt(sum(c * c for c in self._bounds))

    @property
    def max_grad_norms(self) -> list[float]:
        """The bound per group (per-layer) or the single flat bound."""
        return list(self._bounds)

    def accumulate(self) -> Tensor:
        """Clip this physical batch's per-example gradients and add their sum to the accumulator.

        Call after ``loss.backward()``. Returns the per-example (flat) gradient norms ``[B]`` of
        each example's own loss term. Managed parameters' ``.grad`` are left ``None``.
        """
        calls, self._calls = self._calls, []
        self._backward_seen = False
        self._uses = {}
        self._generation += 1
        self._suspended = True
        try:
            with torch.no_grad():
                self._check_stray_gradients()
                return self._accumulate([c for c in calls if c.has_gradient()])
        finally:
            self._suspended = False

    def _check_stray_gradients(self) -> None:
        managed = {id(p) for p in self.parameters}
        changed = [n for n, p in self.module.named_parameters() if (id(p) in managed) != p.requires_grad]
        if changed:
            raise ModelNotSupportedError(
                [
                    Problem(
                        n,
                        "was frozen or unfrozen after the clipper was created, so the set of clipped "
                        "parameters no longer matches the trainable ones",
                        "set requires_grad on every parameter before creating the clipper (make_private)",
                    )
                    for n in changed
                ]
            )
        stray = [p for p in self.parameters if p.grad is not None]
        if not stray:
            return
        counts = torch.stack(
            [torch.count_nonzero(g).to("cpu") for g in (p.grad for p in stray) if g is not None]
        )
        bad = [p for p, n in zip(stray, counts.tolist(), strict=True) if n > 0]
        for p in self.parameters:
            p.grad = None
        if bad:
            raise ModelNotSupportedError(
                [
                    Problem(
                        self._names[id(p)],
                        "received a gradient that did not pass through the forward of a module owning it "
                        "(used outside that module, or a stale .grad), so its per-example gradient was not "
                        "observed",
                        "use each parameter only inside the forward of a module that owns it, and call "
                        "optimizer.zero_grad() before each backward",
                    )
                    for p in bad
                ]
            )

    @staticmethod
    def _refuse(location: str, reason: str, fix: str) -> ModelNotSupportedError:
        return ModelNotSupportedError([Problem(location, reason, fix)])

    def _accumulate(self, calls: list[_Call]) -> Tensor:
        late, self._late = self._late, False
        if late or len({c.generation for c in calls}) > 1:
            raise self._refuse(
                "model",
                "gradients from more than one backward pass were captured before accumulate(), so "
                "examples of different passes cannot be told apart (reentrant activation "
                "checkpointing, which runs a backward inside the backward, does this too)",
                "call accumulate() after each backward, before the next forward; use "
                "checkpoint(..., use_reentrant=False) for activation checkpointing",
            )
        sizes = {c.record.batch_size for c in calls}
        if len(sizes) > 1:
            detail = ", ".join(f"{_location(c.site.name)}: {c.record.batch_size}" for c in calls)
            raise self._refuse(
                "model",
                f"layers saw different numbers of examples in dimension 0 ({detail})",
                "keep the examples in dimension 0 of every layer's input (batch_first), "
                "without reshaping them into other dimensions",
            )
        groups = {c.record.group for c in calls}
        if len(groups) > 1:
            raise self._refuse(
                "model",
                f"layers of one backward pass were captured with different group sizes {sorted(groups)}",
                "change group_size only between physical batches (after accumulate)",
            )
        group = groups.pop() if groups else 1
        ref = self.parameters[0] if self.parameters else None
        rows = sizes.pop() if sizes else 0
        batch, scale = self._examples_and_scale(calls, rows, group)
        norm_dtype = torch.promote_types(ref.dtype, torch.float32) if ref is not None else torch.float32
        device = ref.device if ref is not None else torch.device("cpu")
        if batch == 0 or ref is None:
            return torch.zeros(batch, dtype=norm_dtype, device=device)

        uses: dict[int, int] = {}
        for call in calls:
            for p in call.site.params:
                uses[id(p)] = uses.get(id(p), 0) + 1
        shared = {pid for pid, n in uses.items() if n > 1}
        squares: list[list[Tensor]] = [[] for _ in self.groups]
        materialised: dict[int, Tensor] = {}
        ghosts: list[tuple[int, Ghost]] = []
        for call in calls:
            site = call.site
            contributions, forced = self._contributions_of(call, shared)
            for name, p in zip(site.names, site.params, strict=True):
                c = contributions.get(name)
                if c is None:
                    continue
                self._check_shape(site, name, p, c, batch)
                pid = id(p)
                if isinstance(c, Materialised):
                    prev = materialised.get(pid)
                    materialised[pid] = c.grads if prev is None else prev + c.grads
                elif name in forced or pid in shared:
                    raise RuntimeError(f"veil: rule for {_location(site.name)} ignored materialise={name}")
                else:
                    squares[self._group_of[pid]].append(c.norm_sq.to(norm_dtype))
                    ghosts.append((pid, c))
        for pid, grads in materialised.items():
            norm = torch.linalg.vector_norm(grads.reshape(batch, -1), dim=1, dtype=norm_dtype)
            squares[self._group_of[pid]].append(norm.square())

        def total(parts: list[Tensor]) -> Tensor:
            if not parts:
                return torch.zeros(batch, dtype=norm_dtype, device=device)
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)

        margin = self._rounding_margin()
        if self.clipping == "flat":
            flat_norms = total([t for parts in squares for t in parts]).sqrt() * scale
            weight = torch.clamp(self._bounds[0] / (flat_norms + _STABILITY), max=1.0) * (scale * margin)
            weights = [weight] * len(self.groups)
        else:
            group_sq = torch.stack([total(parts) for parts in squares])
            flat_norms = group_sq.sum(dim=0).sqrt() * scale
            bounds = torch.tensor(self._bounds, dtype=norm_dtype, device=device).unsqueeze(1)
            factors = torch.clamp(bounds / (group_sq.sqrt() * scale + _STABILITY), max=1.0)
            weights = list((factors * (scale * margin)).unbind(0))

        # Weighted sums at ≥ float32 (weights are never cast down; one rounding to the accumulator).
        added: dict[int, Tensor] = {}
        for pid, grads in materialised.items():
            work = torch.promote_types(grads.dtype, norm_dtype)
            w = weights[self._group_of[pid]].to(work)
            added[pid] = (
                (w @ grads.reshape(batch, -1).to(work)).view(grads.shape[1:]).to(self._sum_dtype[pid])
            )
        for pid, ghost in ghosts:
            part = ghost.weighted_sum(weights[self._group_of[pid]]).to(self._sum_dtype[pid])
            added[pid] = part if pid not in added else added[pid] + part
        if self._sum is None:
            self._sum = [
                added[id(p)] if id(p) in added else torch.zeros_like(p, dtype=self._sum_dtype[id(p)])
                for p in self.parameters
            ]
        else:
            for i, p in enumerate(self.parameters):
                if id(p) in added:
                    self._sum[i] += added[id(p)]
        return flat_norms

    def _examples_and_scale(self, calls: list[_Call], rows: int, group: int) -> tuple[int, float]:
        """(clipped objects in the batch, factor turning autograd's gradients into theirs).

        Rows (group 1): ``B`` examples; augmentation multiplicity: ``rows/K`` examples, whose
        summed row gradients times the factor are the gradient of the mean of the example's copies;
        privacy units: ``U`` units, whose row gradients were already weighted by ``1/n_u`` in
        :func:`_per_example`, so the factor only undoes the loss's mean over the ``rows``."""
        unit_sets = {id(c.units) for c in calls}
        if len(unit_sets) > 1:
            raise self._refuse(
                "model",
                "layers of one backward pass were captured with different unit_index tensors",
                "change unit_index only between physical batches (after accumulate)",
            )
        units = calls[0].units if calls else None
        if units is not None:
            count = int(units.max()) + 1 if units.numel() else 0
            return count, float(rows) if self.loss_reduction == "mean" else 1.0
        batch = rows // group
        # Autograd's gradient of an example's rows, times scale, is the gradient of the example's
        # own loss term (the mean of its K copies' losses).
        return batch, float(batch) if self.loss_reduction == "mean" else 1.0 / group

    def _contributions_of(self, call: _Call, shared: set[int]) -> tuple[dict[str, Contribution], Set[str]]:
        site = call.site
        if call.contributions is None and call.error is None:
            forced = {
                n
                for n, p in zip(site.names, site.params, strict=True)
                if id(p) in shared or _rows_unknown(call)
            }
            try:
                call.contributions = _per_example(
                    call, site.rule.contributions(site.module, call.record, site.names, forced)
                )
            except RuleError as exc:
                call.error = exc
            call.forced = frozenset(forced)
            call.release()
        if call.error is not None:
            raise self._refuse(
                f"{_location(site.name)} ({type(site.module).__name__})", call.error.reason, call.error.fix
            ) from call.error
        assert call.contributions is not None
        return call.contributions, call.forced

    @staticmethod
    def _check_shape(site: _Site, name: str, p: nn.Parameter, c: Contribution, batch: int) -> None:
        got = c.grads.shape if isinstance(c, Materialised) else c.norm_sq.shape
        want = (batch, *p.shape) if isinstance(c, Materialised) else (batch,)
        if tuple(got) != tuple(want):
            raise RuntimeError(
                f"veil: rule {type(site.rule).__name__} gave shape {tuple(got)} for "
                f"{_location(site.name)}.{name}, expected {want}"
            )

    @property
    def _sum_dtype(self) -> dict[int, torch.dtype]:
        """Accumulator dtype per parameter: the parameter's own, at least float32."""
        return {id(p): torch.promote_types(p.dtype, torch.float32) for p in self.parameters}

    def _rounding_margin(self) -> float:
        """``1 - 2u`` for the coarsest parameter dtype (unit roundoff ``u``: bf16 2⁻⁸, fp16 2⁻¹¹).

        Clip factors are computed at ≥ float32 and multiplied by this margin, so that a contribution
        rounded to its parameter's dtype (one rounding per coordinate, relative error ≤ u) keeps
        norm ≤ C, with u of slack left for float32 arithmetic in the norms and the weighted sums.
        """
        roundoff = max((torch.finfo(p.dtype).eps / 2 for p in self.parameters), default=0.0)
        return 1.0 - 2.0 * roundoff

    def clipped_sum(self) -> list[Tensor]:
        """``Σ clip(g_i)`` over everything accumulated since :meth:`reset`, aligned with :attr:`parameters`.

        In each parameter's dtype promoted to at least float32 (a bfloat16/float16 parameter's sum
        is accumulated in float32; rounding to the parameter's dtype happens once, after noise).
        Zeros when nothing was accumulated. The tensors are the accumulator itself (no copy);
        they stay valid after :meth:`reset`, which starts a new accumulator.
        """
        if self._sum is None:
            return [torch.zeros_like(p, dtype=self._sum_dtype[id(p)]) for p in self.parameters]
        return list(self._sum)

    def reset(self) -> None:
        """Start a new, empty accumulator and drop inputs captured since the last accumulate."""
        self._sum = None
        self._calls = []
        self._late = False
        self._backward_seen = False
        self._uses = {}
        self._generation += 1

    def remove(self) -> None:
        """Detach every hook and restore any parameter a forward interrupted left not requiring grad."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param, _, before in self._toggled.values():
            param.requires_grad_(before)
        self._toggled = {}
        for site in self._sites:
            site.frames.clear()
            if _ATTACHED.get(site.module) is self:
                del _ATTACHED[site.module]
        self._calls = []


def _rows_unknown(call: _Call) -> bool:
    """Whether the call's rule must materialise per row so that the clipper can sum each group
    (augmentation copies a rule cannot group itself, or privacy units of any size)."""
    return call.units is not None or (call.record.group > 1 and not call.site.rule.groups_rows)


def _per_example(call: _Call, contributions: dict[str, Contribution]) -> dict[str, Contribution]:
    """A rule's contributions per clipped object.

    Augmentation multiplicity, for a rule that does not group rows itself (it was asked to
    materialise): each example's ``K`` row gradients summed (exact: the example's loss is the
    average of its copies' and autograd's row gradients already carry the 1/K). Privacy units:
    each unit's row gradients weighted by ``1/n_u`` (``n_u`` its rows in the batch) and summed,
    the mean of its rows' gradients up to the loss's own scale (see ``_examples_and_scale``)."""
    if not _rows_unknown(call):
        return contributions
    out: dict[str, Contribution] = {}
    for name, c in contributions.items():
        if not isinstance(c, Materialised):
            raise RuntimeError(f"veil: rule for {_location(call.site.name)} ignored materialise={name}")
        grads = c.grads
        if call.units is not None:
            out[name] = Materialised(unit_means(grads, call.units))
        else:
            k = call.record.group
            out[name] = Materialised(grads.reshape(grads.shape[0] // k, k, *grads.shape[1:]).sum(dim=1))
    return out


def _autocast_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, torch.dtype] | None:
    """The autocast setting the forward ran under (device type of the first tensor input)."""
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
    device_type = first.device.type if first is not None else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)


def _owned(module: nn.Module, record: CallRecord) -> list[Any]:
    """Tensors an output must not share memory with to be reattached without a copy."""
    inputs = flatten((record.args, record.kwargs))[0]
    return [*inputs, *module.parameters(), *module.buffers()]


def _detached(obj: Any) -> Any:
    if isinstance(obj, tuple) and all(isinstance(t, Tensor) for t in obj):
        return tuple(t.detach() for t in obj)
    return map_tensors(obj, lambda t: t.detach())
