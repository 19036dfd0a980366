"""The DP optimizer: clipped sum → Gaussian noise → scale → the user's own torch optimizer.

Guarantee (per logical step, add/remove-one neighbouring). With clip norm C, noise multiplier σ and
expected batch size B = q·N, one logical step releases

    ḡ = (Σ_{i ∈ batch} clip_C(g_i) + N(0, σ²Δ²·I)) / B

where g_i is the gradient of example i's own loss term, ``Δ`` the clipper's L2 sensitivity of the
clipped sum (Δ = C for flat clipping) and the sum runs over the whole logical batch, however many
physical chunks it arrived in. Adding or removing one example changes the sum by at most Δ, so the
release is the Gaussian mechanism with multiplier σ on the sampled batch; the user's optimizer (any
``torch.optim`` optimizer: SGD, Adam, weight decay, ...) only post-processes ḡ. The divisor B is a
constant, never the realised batch size (with it the sensitivity would depend on the batch).
The engine composes one privacy event *before* ḡ is written, so no update goes unaccounted.

Each release closes a logical batch drawn for it alone (the ``PoissonSampled(q, ·)`` event of each
step assumes its own independent sample). ``step()`` consumes the chunk the private loader handed
out last (:class:`veil.sampling.StepSignal`): a ``step()`` with no new chunk since the previous one
(two steps on one batch: an inner-steps loop, Lightning manual optimization stepping twice) is
refused with :class:`~veil.errors.SamplingError` before the closure runs, any noise is drawn or
anything is accounted; what the refused step's backward captured and the unreleased clipped sums
are dropped. Two releases on one sample would be one sampled Gaussian of multiplier σ/√2, not two
independent sampled events. A logical batch left unreleased (a ``break`` or a fresh ``iter(loader)``
mid-batch, a step skipped) releases nothing: when a chunk of a later logical batch arrives, the
clipped sums of the earlier one are dropped (never released with another sample, which would count
a record in both twice) and nothing is composed for it. Both rules depend on the order of the
calls alone, never on a value. A loop that skips a step on a value it computed from the rows (a
loss it inspects) makes the release pattern depend on the data: that is outside the guarantee, as
is any private value the loop itself prints.

Assumptions: one ``loss.backward()`` per physical batch, ``step()`` after each, the batch stepped
on is the one the loader handed out last, and the clipper sees every trainable parameter (checked
by :meth:`veil.PrivacyEngine.make_private`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from veil.errors import ConfigError, SamplingError
from veil.host_release import finisher
from veil.noise_ahead import NoiseAhead, NoiseKey, worth_drawing_ahead

if TYPE_CHECKING:
    from veil.clipping import PerSampleClipper
    from veil.mechanisms.rng import RandomSource
    from veil.sampling import StepSignal

__all__ = ["DPOptimizer"]


class DPOptimizer(Optimizer):
    """Wraps the user's optimizer; ``step()`` privatises the gradient, then applies the user's step.

    Shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer, so learning-rate
    schedulers and the optimizer's ``state_dict`` work as before. On a physical chunk that does not
    close its logical batch, ``step()`` only accumulates the clipped per-sample gradients and returns
    without touching the parameters.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        clipper: PerSampleClipper,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int,
        noise_source: RandomSource,
        signal: StepSignal,
        on_release: Callable[[], None],
    ) -> None:
        # No super().__init__: this object is a view on ``optimizer``, not a second optimizer.
        self.original_optimizer = optimizer
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.clipper = clipper
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = int(expected_batch_size)
        self._denominator = float(expected_batch_size)
        self._noise = noise_source
        self._signal = signal
        self._on_release = on_release
        self.pending_chunks = 0
        # The loader's chunk and logical-batch serials (StepSignal) at the last step(): a step needs
        # a new chunk; pending chunks of an earlier logical batch than the current one are dropped.
        self._stepped_chunk = signal.chunks
        self._pending_batch = signal.logical_batches
        self.adaptive: Any = None  # a veil.clipping.adaptive.AdaptiveClipping hook, when enabled
        self.loss_guard: Any = None  # a veil.per_example_loss.LoopLossGuard, set by the engine
        # The next step's noise, drawn on a worker thread while the next forward/backward run (secure
        # sources only: a seeded stream is drawn at the step, in order), where a core is free for it.
        # See veil.noise_ahead.
        self.noise_ahead = NoiseAhead(noise_source)
        devices = [p.device for p in clipper.parameters]
        coordinates = sum(p.numel() for p in clipper.parameters)
        self.draw_ahead = bool(noise_source.secure) and worth_drawing_ahead(devices, coordinates)
        # Whether something reads the clipper's Σ clip(g_i) after the release (the gradient-canary
        # auditor's step pre-hook sets it): then the release is written beside the sums, else a
        # secure host draw made at the step writes it over them (one model-sized buffer less).
        self.keep_clipped_sum = False

    @property
    def noise_draws(self) -> int:
        """Noise draws made so far (ahead or at the step), for tests and logs."""
        return self.noise_ahead.draws

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to the clipped sum: σ·Δ (before dividing by B)."""
        return self.noise_multiplier * float(self.clipper.sensitivity)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` of every parameter; per-sample state of an unfinished logical batch is kept."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(
            "param_group",
            f"{len(list(param_group.get('params', [])))} parameter(s)",
            "parameters added after make_private have no per-sample clipping, so their updates would "
            "carry unbounded per-example influence",
            "add every parameter group to the optimizer before calling make_private",
        )

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)
        # torch rebinds ``state`` and ``param_groups`` on load: follow it.
        self.state = self.original_optimizer.state
        self.param_groups = self.original_optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Accumulate this physical batch; at the end of a logical batch add noise once and update.

        Refused (:class:`~veil.errors.SamplingError`, before the closure, the noise or the
        accountant) without a new chunk from the private loader since the previous step; the clipped
        sums of an earlier, unreleased logical batch are dropped first (see the module doc)."""
        self._consume_chunk()
        if self.pending_chunks and self._signal.logical_batches != self._pending_batch:
            self._drop_unreleased(captured=False)  # a logical batch left unreleased: nothing of it goes out
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.loss_guard is not None:
            self.loss_guard.check()  # a loss scaled in the loop is refused before anything is released
        norms = self.clipper.accumulate()
        if self.adaptive is not None:
            self.adaptive.observe(norms)
        if not self._signal.last_chunk:
            self.pending_chunks += 1
            self._pending_batch = self._signal.logical_batches
            return loss
        self._on_release()  # account first: a failure below can only over-count
        self._write_private_grads()
        self.original_optimizer.step()
        if self.adaptive is not None:
            self.adaptive.release()  # the noisy count and the next C, after this step's clipping
        self.clipper.reset()
        self.pending_chunks = 0
        self._draw_next_noise_ahead()
        return loss

    def _consume_chunk(self) -> None:
        """Take the chunk the loader handed out last, or refuse: a step needs a new one.

        On refusal whatever is unreleased (the pending chunks' sums, the inputs and gradients the
        refused step's backward captured) is dropped, so a caught error leaves nothing stale."""
        signal = self._signal
        if signal.chunks != self._stepped_chunk:
            self._stepped_chunk = signal.chunks
            return
        self._drop_unreleased(captured=True)
        if signal.chunks:
            value = f"a second step on the chunk last handed out (logical batch {signal.logical_batches})"
        else:
            value = "a step before the private loader handed out any batch"
        raise SamplingError(
            "optimizer.step()",
            value,
            "each noisy step is accounted as its own Poisson sample; a step on a batch already "
            "stepped on (or not drawn from the private loader) would release the same sample twice "
            "and under-state ε",
            "take one optimizer.step() per batch from the loader make_private returned (draw a new "
            "batch for each step; for more steps, plan more steps or a larger batch)",
        )

    def _drop_unreleased(self, *, captured: bool) -> None:
        """Forget the clipped sums (and adaptive clipping's norms) of chunks not yet released, and,
        with ``captured``, the inputs and gradients captured since the last accumulate too."""
        if captured:
            self.clipper.reset()
        else:
            self.clipper.drop_sum()
        if self.adaptive is not None:
            self.adaptive.norms = []
        self.pending_chunks = 0

    def noisy_count(self, centred: float, std: float) -> float:
        """The logical batch's ``centred`` count plus one draw of N(0, std²) from the run's noise
        source (adaptive clipping's released count; a distributed optimizer sums the ranks' counts
        and draws the noise once)."""
        return centred + float(self._noise.normal((1,), std, dtype=torch.float64)[0])

    def _draw_next_noise_ahead(self) -> None:
        """Start drawing the next step's noise on a worker thread, at the σΔ/B known now.

        Taken by the next step only if it still fits (same σΔ/B, parameters, dtype and device; see
        :mod:`veil.noise_ahead`); a seeded source never draws ahead.
        """
        std = self.noise_std / self._denominator
        if not (self.draw_ahead and self._noise.secure) or std == 0:
            return
        for key, members in self._noise_groups().items():
            numel = sum(self.clipper.parameters[i].numel() for i in members)
            self.noise_ahead.prepare(key, numel, std, background=True)

    @torch.no_grad()
    def _write_private_grads(self) -> None:
        """``p.grad = (Σ clip(g_i) + N(0, σ²Δ²I)) / B`` for every clipped parameter.

        Noise is drawn once per logical step and per (dtype, device): one draw of
        ``N(0, (σΔ/B)²)`` for all the group's coordinates (at float32 for bfloat16/float16
        parameters, else at the parameter's dtype), whose slices become the gradients after the
        clipped sum, scaled by ``1/B``, is added to them; each coordinate therefore carries noise
        of std ``σΔ/B``, independent across coordinates and steps. With a secure source the draw
        is made ahead, on a worker thread while this step's forward and backward ran, and used here
        only if it still fits (:mod:`veil.noise_ahead`); with a seeded source, here, in order. A
        secure float32 draw made here on the host is finished chunk by chunk inside the draw (sum
        added, grid applied while the chunk is in the cache: :mod:`veil.host_release`), and, unless
        something reads the clipped sums after the release (:attr:`keep_clipped_sum`), written over
        the sums themselves, which then are the gradients.

        The noisy gradient is then rounded to a fixed grid (a power of two near ``σΔ/B / 256``, see
        :func:`release_grid`): a post-processing, so no privacy is lost. Without it, float32
        addition leaks: an output near 0 produced from a sum of 0 can carry finer float bits than
        any ``fl(v + Δ/B)`` can, which certifies the input (the floating-point attack; a test
        reruns it on this release). On the grid every output is reachable from both neighbours.
        """
        std = self.noise_std
        sums = self.clipper.clipped_sum()
        if std == 0:
            self.noise_ahead.clear()
            for p, summed in zip(self.clipper.parameters, sums, strict=True):
                # A new tensor: the clipper's accumulator keeps Σ clip(g_i) until reset() (an
                # auditor reads it); low-precision parameters are divided at float32, cast once.
                work = torch.promote_types(p.dtype, torch.float32)
                g = summed.to(work) / self._denominator
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
            return
        inverse = 1.0 / self._denominator
        grid = release_grid(std * inverse)
        for key, members in self._noise_groups().items():
            numels = [self.clipper.parameters[i].numel() for i in members]
            flat = self.noise_ahead.buffered(key, sum(numels), std * inverse)  # drawn ahead
            group_sums = [sums[i] for i in members]
            if flat is None and (
                self._release_from_reserve(key, group_sums, std, grid)
                or self._release_into_sums(key, group_sums, std, grid)
            ):
                for i in members:
                    p = self.clipper.parameters[i]
                    g = sums[i].view(p.shape)
                    p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
                continue
            finished = False
            if flat is None:  # drawn now: where the source draws in chunks, finished chunk by chunk
                finish = None
                if self.noise_ahead.finishes_in_draw(key):
                    finish = finisher([sums[i] for i in members], inverse, grid)
                flat, finished = self.noise_ahead.draw_now(key, sum(numels), std * inverse, finish)
            pieces = flat.split(numels)
            if not finished:
                for i, piece in zip(members, pieces, strict=True):
                    piece.view(self.clipper.parameters[i].shape).add_(sums[i], alpha=inverse)
                # Rounded once for the whole group (three ops, not three a parameter: on a busy machine
                # each multi-threaded op waits for its threads); exact: grid is a power of two.
                flat.div_(grid).round_().mul_(grid)
            for i, piece in zip(members, pieces, strict=True):
                p = self.clipper.parameters[i]
                g = piece.view(p.shape)
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)

    def _release_from_reserve(self, key: NoiseKey, sums: list[torch.Tensor], std: float, grid: float) -> bool:
        """Write group ``key``'s release over its clipped sums ``sums`` with this step's row of a
        secure draw made for several steps at once (:meth:`~veil.noise_ahead.NoiseAhead.reserved`: a
        small group, where the draw made at the step costs twice its isolated time); the same release
        as :meth:`_release_into_sums` (:func:`~veil.host_release.finisher` with ``into``, one call over
        the row). ``False`` (nothing taken) where no reserve applies, something reads the sums after the
        release (:attr:`keep_clipped_sum`), or adaptive clipping changes the std every step."""
        if self.keep_clipped_sum or self.adaptive is not None or not self._noise.secure:
            return False
        inverse = 1.0 / self._denominator
        finish = finisher(sums, inverse, grid, into=True)
        if finish is None:
            return False
        numel = sum(s.numel() for s in sums)
        noise = self.noise_ahead.reserved(key, numel, std * inverse)
        if noise is None:
            return False
        try:
            finish(noise, 0, numel)
        except BaseException:
            self.clipper.reset()  # as in _release_into_sums: a retry must not release a partly written sum
            raise
        return True

    def _release_into_sums(self, key: NoiseKey, sums: list[torch.Tensor], std: float, grid: float) -> bool:
        """Draw group ``key``'s noise now and write the release over its clipped sums ``sums``, chunk
        by chunk (:func:`~veil.host_release.finisher` with ``into``): the same values the draw into a
        buffer of its own gives, without that buffer. Only where nothing reads the sums afterwards
        (:attr:`keep_clipped_sum`) and the source draws float32 on the host in chunks; ``False``
        (nothing drawn) otherwise."""
        if self.keep_clipped_sum or not self.noise_ahead.finishes_in_draw(key):
            return False
        inverse = 1.0 / self._denominator
        finish = finisher(sums, inverse, grid, into=True)
        numel = sum(s.numel() for s in sums)
        try:
            return finish is not None and self.noise_ahead.release_into(key, numel, std * inverse, finish)
        except BaseException:
            # Part of the sums may already hold the release: a retried step must not add its own
            # release to them (a wrong scale), so the accumulator is dropped (a retry sees zero).
            self.clipper.reset()
            raise

    def _noise_groups(self) -> dict[NoiseKey, list[int]]:
        """Indices of the clipped parameters per (noise dtype, device): ≥ float32, the parameter's own."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(self.clipper.parameters):
            key = (torch.promote_types(p.dtype, torch.float32), p.device)
            groups.setdefault(key, []).append(i)
        return groups

    def __repr__(self) -> str:
        inner = type(self.original_optimizer).__name__
        return (
            f"DPOptimizer({inner}, noise_multiplier={self.noise_multiplier}, "
            f"max_grad_norm={self.max_grad_norm}, expected_batch_size={self.expected_batch_size})"
        )


def release_grid(std: float) -> float:
    """The power of two ``2^(⌊log2 std⌋ − 8)``: a rounding step ≤ std/256 (utility: nothing), coarse
    enough that float32 resolves every grid point within ±2¹⁴·std of 0 from any neighbouring input."""
    return math.ldexp(1.0, math.floor(math.log2(std)) - 8)
