"""Hooks: what the clipper captures of each forward call, and each output's gradient during backward.

Forward hooks keep each site's inputs (detached); tensor hooks on its outputs receive the output
gradients during the user's backward. While a site runs forward its parameters are made not to
require grad (for rules that allow it), so autograd does not also compute the summed, non-private
weight gradient. A rule that can run as soon as its single output gradient arrives runs inside the
backward pass (:meth:`Capture._process_now`), so its inputs and output gradient are freed early.
Generations tell one backward pass's calls from the next; a second backward through the same
forward is flagged (``late``) and refused at accumulate. Hooks belong to this object: a module can be
hooked by one clipper at a time, and :meth:`Capture.remove` detaches them and restores every
parameter's ``requires_grad``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from veil.clipping._autograd import reattach
from veil.clipping._tree import flatten, map_tensors
from veil.clipping.norms import per_example, rows_unknown
from veil.clipping.registry import CallRecord, RuleError, is_floating
from veil.clipping.sites import Call, Site, location
from veil.errors import InvalidParameterError, ModelNotSupportedError, Problem

__all__ = ["Capture"]

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Capture] = weakref.WeakKeyDictionary()


class Capture:
    """The hooks of one clipper on its sites, and what they captured since the last accumulate."""

    def __init__(self, sites: list[Site]) -> None:
        self.sites = sites
        self.handles: list[RemovableHandle] = []
        self.calls: list[Call] = []
        self.generation = 0
        self.backward_seen = False
        self.late = False
        self.uses: dict[int, dict[int, int]] = {}  # generation -> id(param) -> forward calls
        self.toggled: dict[int, tuple[nn.Parameter, int, bool]] = {}  # id -> (param, depth, before)
        self.suspended = False
        self.group = 1
        """Rows per example (augmentation multiplicity K) for the calls captured from now on."""
        self.units: Tensor | None = None
        """The privacy unit of each row of the next forward, or None."""
        self.inputs: dict[int, tuple[weakref.ref[Tensor], int, dict[Any, Tensor]]] = {}
        """id(first input) -> (the input, its version, the cache) of this generation's sharing calls."""

    def take(self) -> list[Call]:
        """The calls of the backward pass just finished; the next forward starts a new generation."""
        calls, self.calls = self.calls, []
        self.backward_seen = False
        self.uses = {}
        self.inputs = {}
        self.generation += 1
        return calls

    def reset(self) -> None:
        """Drop inputs captured since the last accumulate; a new generation."""
        self.calls = []
        self.late = False
        self.backward_seen = False
        self.uses = {}
        self.inputs = {}
        self.generation += 1

    def attach(self) -> None:
        for site in self.sites:
            other = _ATTACHED.get(site.module)
            if other is not None and other is not self:
                self.remove()
                raise InvalidParameterError(
                    "module",
                    location(site.name),
                    "it is already hooked by another PerSampleClipper, whose hooks would interfere",
                    "call remove() on the previous clipper (or its engine) first",
                )
            _ATTACHED[site.module] = self
            self.handles.append(site.module.register_forward_pre_hook(self._pre_hook(site), with_kwargs=True))
            self.handles.append(
                site.module.register_forward_hook(self._post_hook(site), with_kwargs=True, always_call=True)
            )

    def _pre_hook(self, site: Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.suspended or not torch.is_grad_enabled():
                site.frames.append(None)
                return
            try:
                batch = site.rule.batch_size(module, args, kwargs)
            except ValueError as exc:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{location(site.name)} ({type(module).__name__})",
                            str(exc),
                            "feed batches with the examples in dimension 0",
                        )
                    ]
                ) from exc
            units = self.units
            if units is not None and units.numel() != batch:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{location(site.name)} ({type(module).__name__})",
                            f"it saw {batch} rows but unit_index names {units.numel()}, so rows cannot be "
                            "assigned to their privacy units",
                            "set clipper.unit_index to one label per row of the batch (the engine's "
                            "loader does this)",
                        )
                    ]
                )
            if batch % self.group:
                raise ModelNotSupportedError(
                    [
                        Problem(
                            f"{location(site.name)} ({type(module).__name__})",
                            f"it saw {batch} rows, not a whole number of groups of {self.group} "
                            "augmented copies, so rows cannot be assigned to their examples",
                            "feed each example's K copies as K consecutive rows (veil.augment.multiplicity)",
                        )
                    ]
                )
            if self.backward_seen:  # a forward after a backward starts a new generation
                self.generation += 1
                self.backward_seen = False
                self.inputs = {}
            uses = self.uses.setdefault(self.generation, {})
            for p in site.params:
                uses[id(p)] = uses.get(id(p), 0) + 1
            record = CallRecord(
                args=_detached(args),
                kwargs=_detached(kwargs) if kwargs else {},
                batch_size=batch,
                autocast=_autocast_state(args, kwargs),
                group=self.group,
                shared=self._shared(args, kwargs) if site.rule.shares_input else None,
            )
            call = Call(site, record, self.generation, units=units)
            context = site.rule.forward_context(module, record)
            toggled = site.rule.toggle_requires_grad
            if toggled:
                for p in site.params:
                    _, count, before = self.toggled.get(id(p), (p, 0, p.requires_grad))
                    if count == 0:
                        p.requires_grad_(False)
                    self.toggled[id(p)] = (p, count + 1, before)
            if context is not None:
                context.__enter__()
            site.frames.append((call, context, toggled))

        return hook

    def _shared(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[Any, Tensor] | None:
        """The cache of the calls of this generation whose first input is this very tensor, unmodified.

        Matched by object identity (a weak reference, so a new tensor that reuses a freed one's id is
        not taken for it) and by version counter (an in-place change in between starts a new cache).
        """
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor) or x.is_inference():  # an inference tensor has no version counter
            return None
        seen = self.inputs.get(id(x))
        if seen is not None and seen[0]() is x and seen[1] == x._version:
            return seen[2]
        cache: dict[Any, Tensor] = {}
        self.inputs[id(x)] = (weakref.ref(x), x._version, cache)
        return cache

    def _release(self, site: Site, frame: tuple[Call, Any, bool]) -> None:
        _, context, toggled = frame
        if context is not None:
            context.__exit__(None, None, None)
        if toggled:
            for p in site.params:
                param, count, before = self.toggled[id(p)]
                if count == 1:
                    del self.toggled[id(p)]
                    param.requires_grad_(before)
                else:
                    self.toggled[id(p)] = (param, count - 1, before)

    def _post_hook(self, site: Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            frame = site.frames.pop() if site.frames else None
            if frame is None:
                return None
            self._release(site, frame)
            call = frame[0]
            self.calls.append(call)
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

    def _watch(self, call: Call, out: Tensor) -> None:
        """Receive the gradient of ``out`` (a module output) during backward."""
        record = call.record
        slot = len(record.grads)
        record.grads.append(None)
        if call.site.rule.keep_outputs:
            record.outputs.append(out.detach())
        single = slot == 0 and call.site.rule.eager and record.batch_size > 0

        def sink(grad: Tensor) -> None:
            self.backward_seen = True
            if call.contributions is not None or call.error is not None or record.grads[slot] is not None:
                self.late = True  # a second backward through the same forward
                return
            record.grads[slot] = grad
            if single and len(record.grads) == 1:
                self._process_now(call)

        out.register_hook(sink)

    def _process_now(self, call: Call) -> None:
        """Run the call's rule inside backward, so its inputs and output gradient can be freed."""
        site = call.site
        uses = self.uses.get(call.generation, {})
        call.forced = frozenset(
            n
            for n, p in zip(site.names, site.params, strict=True)
            if uses.get(id(p), 0) > 1 or rows_unknown(call)
        )
        try:
            with torch.no_grad():
                call.contributions = per_example(
                    call, site.rule.contributions(site.module, call.record, site.names, call.forced)
                )
        except RuleError as exc:
            call.error = exc
        call.release()

    def remove(self) -> None:
        """Detach every hook and restore any parameter a forward interrupted left not requiring grad."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for param, _, before in self.toggled.values():
            param.requires_grad_(before)
        self.toggled = {}
        for site in self.sites:
            site.frames.clear()
            if _ATTACHED.get(site.module) is self:
                del _ATTACHED[site.module]
        self.calls = []


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
