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

One module per concern: :mod:`~veil.clipping.sites` (which modules are hooked, with which rule:
:mod:`~veil.clipping.lookup`, else the :mod:`~veil.clipping.fallback`), :mod:`~veil.clipping.capture`
(the hooks), :mod:`~veil.clipping.norms` (per-sample norms), :mod:`~veil.clipping.clipped_sum` (clip
factors and the weighted sums); this class owns them and the accumulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from veil.clipping import norms
from veil.clipping.capture import Capture
from veil.clipping.clipped_sum import (
    clip_weights,
    finite_examples,
    rounding_margin,
    sum_dtypes,
    weighted_sums,
)
from veil.clipping.sites import Call, check_bounds, discover
from veil.clipping.units import check_unit_index
from veil.errors import InvalidParameterError, ModelNotSupportedError, Problem

__all__ = ["ClippingMode", "LossReduction", "PerSampleClipper"]

ClippingMode = Literal["flat", "per_layer"]
LossReduction = Literal["mean", "sum"]


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
        self._sum: list[Tensor] | None = None
        found = discover(module)
        self._sites = found.sites
        self.groups = found.groups
        self._group_of = found.group_of
        self.parameters = found.parameters
        self._names = found.names
        self._bounds = check_bounds(max_grad_norm, clipping, self.groups)
        self._capture = Capture(self._sites)
        self.dropped_not_finite = 0
        """Examples (or units) dropped from a sum because their gradient was not finite, over every
        accumulate (an example sampled twice counts twice). A count over private data: non-private."""
        self._capture.attach()

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
        return self._capture.group

    @group_size.setter
    def group_size(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidParameterError(
                "group_size",
                k,
                "it counts the augmented copies of each example and must be an integer ≥ 1",
                "pass K ≥ 1 (1: no augmentation multiplicity)",
            )
        if k > 1 and self._capture.units is not None:
            raise InvalidParameterError(
                "group_size", k, "rows are already grouped by privacy unit", "use one grouping at a time"
            )
        self._capture.group = k

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
        return self._capture.units

    @unit_index.setter
    def unit_index(self, units: Tensor | None) -> None:
        if units is not None:
            check_unit_index(units)
            if self._capture.group > 1:
                raise InvalidParameterError(
                    "unit_index",
                    "set with group_size > 1",
                    "rows are already grouped by augmentation multiplicity",
                    "use one grouping at a time",
                )
        self._capture.units = units

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under add/remove-one: ``C`` or ``sqrt(Σ C_k²)``."""
        return math.sqrt(sum(c * c for c in self._bounds))

    @property
    def max_grad_norms(self) -> list[float]:
        """The bound per group (per-layer) or the single flat bound."""
        return list(self._bounds)

    @property
    def _calls(self) -> list[Call]:
        """The forward calls captured since the last :meth:`accumulate` (read-only; for inspection)."""
        return self._capture.calls

    def rows_in_flight(self) -> int | None:
        """Rows of the latest forward captured since the last accumulate (``None`` before any): the
        number the clipper multiplies a ``"mean"`` loss's gradients back by."""
        calls = self._capture.calls
        return int(calls[-1].record.batch_size) if calls else None

    def accumulate(self) -> Tensor:
        """Clip this physical batch's per-example gradients and add their sum to the accumulator.

        Call after ``loss.backward()``. Returns the per-example (flat) gradient norms ``[B]`` of
        each example's own loss term. Managed parameters' ``.grad`` are left ``None``.
        """
        calls = self._capture.take()
        self._capture.suspended = True
        try:
            with torch.no_grad():
                self._check_stray_gradients()
                live = [c for c in calls if c.has_gradient()]
                calls.clear()  # the captured inputs and gradients are freed as soon as they are used
                return self._accumulate(live)
        finally:
            self._capture.suspended = False

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

    def _accumulate(self, calls: list[Call]) -> Tensor:
        """Check the calls, take every example's norm, clip, and add the weighted sums to the accumulator."""
        late, self._capture.late = self._capture.late, False
        rows, group = norms.check_calls(calls, late)
        ref = self.parameters[0] if self.parameters else None
        batch, scale = norms.examples_and_scale(calls, rows, group, self.loss_reduction)
        norm_dtype = torch.promote_types(ref.dtype, torch.float32) if ref is not None else torch.float32
        device = ref.device if ref is not None else torch.device("cpu")
        if batch == 0 or ref is None:
            return torch.zeros(batch, dtype=norm_dtype, device=device)
        found = norms.collect(calls, batch, self._group_of, len(self.groups), norm_dtype)
        calls.clear()  # what is left of each call is in `found`, which weighted_sums consumes
        margin = self._rounding_margin()
        flat_norms, weights = clip_weights(
            found.squares, self._bounds, self.clipping, scale, margin, batch, norm_dtype, device
        )
        keep = finite_examples(flat_norms)  # an example whose gradient is not finite adds zero
        if keep is not None:
            self.dropped_not_finite += int((~keep).sum())
            weights = [torch.where(keep, w, w.new_zeros(())) for w in weights]
        # Weighted sums at ≥ float32 (weights are never cast down; one rounding to the accumulator).
        dtypes = sum_dtypes(self.parameters)
        numels = {id(p): p.numel() for p in self.parameters}  # the largest sums formed last (memory)
        added = weighted_sums(found, weights, self._group_of, dtypes, batch, norm_dtype, keep, numels)
        if self._sum is None:
            self._sum = [
                added[id(p)] if id(p) in added else torch.zeros_like(p, dtype=dtypes[id(p)])
                for p in self.parameters
            ]
        else:
            for i, p in enumerate(self.parameters):
                if id(p) in added:
                    self._sum[i] += added[id(p)]
        return flat_norms

    def _rounding_margin(self) -> float:
        """The clip factors' margin for rounding to the parameters' dtypes (see :func:`rounding_margin`)."""
        return rounding_margin(self.parameters)

    def clipped_sum(self) -> list[Tensor]:
        """``Σ clip(g_i)`` over everything accumulated since :meth:`reset`, aligned with :attr:`parameters`.

        In each parameter's dtype promoted to at least float32 (a bfloat16/float16 parameter's sum
        is accumulated in float32; rounding to the parameter's dtype happens once, after noise).
        Zeros when nothing was accumulated. The tensors are the accumulator itself (no copy);
        they stay valid after :meth:`reset`, which starts a new accumulator. The DP optimizer writes
        its release over them (they become the gradients) unless told that something reads them
        afterwards (:attr:`veil.optimizer.DPOptimizer.keep_clipped_sum`).
        """
        if self._sum is None:
            dtypes = sum_dtypes(self.parameters)
            return [torch.zeros_like(p, dtype=dtypes[id(p)]) for p in self.parameters]
        return list(self._sum)

    def reset(self) -> None:
        """Start a new, empty accumulator and drop inputs captured since the last accumulate."""
        self.drop_sum()
        self._capture.reset()

    def drop_sum(self) -> None:
        """Start a new, empty accumulator; inputs captured since the last accumulate are kept (the
        current chunk's, when the optimizer drops an abandoned logical batch's sums)."""
        self._sum = None

    def remove(self) -> None:
        """Detach every hook and restore any parameter a forward interrupted left not requiring grad."""
        self._capture.remove()
