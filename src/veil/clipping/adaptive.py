"""Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021): the clip norm C follows
a target quantile γ of the per-example gradient norms, learned from a noisy count.

Each logical step, besides the noisy clipped sum, releases the noisy count of examples whose norm
was within C, centred so that its add/remove-one sensitivity is 1/2::

    b = (Σ_{i ∈ batch} (1[‖g_i‖ ≤ C] − 1/2) + N(0, σ_b²)) / B + 1/2,      C ← C · exp(−η (b − γ))

with B the expected batch size (a constant, never the realised one), so b estimates the share of
examples not clipped and C grows while fewer than γ are within it.

Guarantee (add/remove-one, per step). The clipped sum (sensitivity C, noise σ_g·C) and the centred
count (sensitivity 1/2, noise σ_b) are computed on the same Poisson sample; scaled by their noise
they form one Gaussian mechanism of L2 sensitivity √(σ_g⁻² + (2σ_b)⁻²), so the step is exactly one
Poisson-sampled Gaussian with multiplier σ = (σ_g⁻² + (2σ_b)⁻²)^(−1/2) (:func:`step_event`). A run
planned for σ keeps its budget by drawing the gradient noise at σ_g = (σ⁻² − (2σ_b)⁻²)^(−1/2)
(:func:`gradient_noise`): the count is paid for by slightly more gradient noise, and the ledger
charges the same event as a fixed-C step. The update of C is post-processing of released values.

Across ranks (:mod:`veil.distributed`) the count is one release too: each rank's local centred count
is all-reduced, and the count's noise is drawn once (by the rank that draws gradient noise for a
one-coordinate group: rank 0 with a seeded source, one rank's OS entropy with a secure one), so
every rank sees the same noisy count, moves C identically and clips the next step with the same C;
the step's sensitivity stays C and its noise σ_g·C, and the replicas stay identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from veil.accounting.calibrate import dpsgd_event
from veil.accounting.events import PrivacyEvent
from veil.errors import InvalidParameterError

__all__ = ["AdaptiveClip", "AdaptiveClipping", "enable_adaptive_clipping", "gradient_noise", "step_event"]


def gradient_noise(sigma: float, count_std: float) -> float:
    """σ_g for the gradient so that gradient + count together cost exactly multiplier ``sigma``."""
    if not (count_std > sigma / 2):
        raise InvalidParameterError(
            "count_noise",
            count_std,
            f"the count's noise must exceed σ/2 = {sigma / 2:g}: below it the count alone would spend "
            "more than the step's whole budget",
            f"pass a count noise well above {sigma / 2:g} (Andrew et al. use about B/20)",
        )
    return (sigma**-2 - (2 * count_std) ** -2) ** -0.5


def step_event(sampling_rate: float, gradient_sigma: float, count_std: float) -> PrivacyEvent:
    """The event of one adaptive-clipping step: one Poisson-sampled Gaussian, the two noises combined."""
    return dpsgd_event(sampling_rate, (gradient_sigma**-2 + (2 * count_std) ** -2) ** -0.5)


@dataclass
class AdaptiveClip:
    """The clip norm's state: current ``clip``, target quantile, geometric learning rate, count noise."""

    clip: float
    target_quantile: float
    count_std: float
    expected_batch_size: float
    lr: float = 0.2

    def __post_init__(self) -> None:
        if not (0 < self.target_quantile < 1):
            raise InvalidParameterError(
                "target_quantile",
                self.target_quantile,
                "a quantile lies strictly between 0 and 1",
                "pass 0.5",
            )
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise InvalidParameterError(
                "max_grad_norm", self.clip, "the initial clip must be > 0", "pass 1.0"
            )

    def centred_count(self, norms: np.ndarray) -> float:
        """Σ (1[‖g_i‖ ≤ C] − 1/2) over ``norms`` (a half-integer: exact in float64, so summing the
        ranks' counts gives the one-process count bit for bit)."""
        return float(np.sum(np.asarray(norms) <= self.clip)) - len(norms) / 2

    def move(self, noisy_centred: float) -> float:
        """C ← C·exp(−η(b − γ)) from the released noisy centred count; returns the share b."""
        b = noisy_centred / self.expected_batch_size + 0.5
        self.clip *= math.exp(-self.lr * (b - self.target_quantile))
        return b

    def update(self, norms: np.ndarray, noise: float) -> float:
        """One step: ``norms`` of the sampled examples (before clipping), ``noise`` a draw of
        N(0, count_std²) from the run's noise source; returns the released share b (new C kept)."""
        return self.move(self.centred_count(norms) + noise)


class AdaptiveClipping:
    """The optimizer hook: collects each logical batch's norms, then releases the noisy count and
    moves the clipper's flat bound. Enable with :func:`enable_adaptive_clipping`."""

    def __init__(self, optimizer: Any, state: AdaptiveClip) -> None:
        self.optimizer = optimizer
        self.state = state
        self.norms: list[np.ndarray] = []
        self.history: list[dict[str, float]] = []

    def observe(self, norms: Any) -> None:
        self.norms.append(norms.detach().double().cpu().numpy())

    def release(self) -> None:
        """The logical step's noisy count (over every rank's examples when distributed, its noise
        drawn once: :meth:`~veil.optimizer.DPOptimizer.noisy_count`), then the next C."""
        norms = np.concatenate(self.norms) if self.norms else np.zeros(0)
        self.norms = []
        noisy = self.optimizer.noisy_count(self.state.centred_count(norms), self.state.count_std)
        b = self.state.move(noisy)
        self._apply()
        self.history.append({"released_share": b, "clip": self.state.clip})

    def _apply(self) -> None:
        self.optimizer.clipper._bounds[0] = self.state.clip
        self.optimizer.max_grad_norm = self.state.clip

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the current clip norm and the released history (both already
        public: functions of the released noisy counts)."""
        return {"clip": self.state.clip, "history": [dict(h) for h in self.history]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state_dict`: C resumes at its saved value, not the first."""
        clip = float(state["clip"])
        if not (clip > 0 and math.isfinite(clip)):
            from veil.errors import CheckpointError

            raise CheckpointError(
                "adaptive_clip",
                clip,
                "a saved clip norm must be finite and > 0",
                "restore an intact checkpoint",
            )
        self.state.clip = clip
        self.history = [dict(h) for h in state.get("history", [])]
        self._apply()


def enable_adaptive_clipping(
    optimizer: Any, *, target_quantile: float, count_std: float | None = None, lr: float = 0.2
) -> AdaptiveClipping:
    """Turn a flat-clipping :class:`~veil.optimizer.DPOptimizer` adaptive, keeping its step's event.

    The optimizer's multiplier σ (what the engine charges per step) becomes the *combined* one: the
    gradient noise is raised to :func:`gradient_noise` (σ, count noise), so the ledger's step event
    stays exact. ``count_std`` defaults to B/20 (Andrew et al.)."""
    if len(optimizer.clipper.max_grad_norms) != 1 or optimizer.clipper.clipping != "flat":
        raise InvalidParameterError(
            "clipping", optimizer.clipper.clipping, "adaptive clipping tracks one flat clip norm", "use flat"
        )
    b = optimizer.expected_batch_size
    std = count_std if count_std is not None else b / 20
    sigma = optimizer.noise_multiplier
    optimizer.noise_multiplier = gradient_noise(sigma, std)
    hook = AdaptiveClipping(optimizer, AdaptiveClip(optimizer.max_grad_norm, target_quantile, std, b, lr))
    optimizer.adaptive = hook
    return hook


def record_adaptive_clipping(optimizer: Any, target_quantile: float, ledger: Any) -> AdaptiveClipping:
    """``veil train --clip adaptive``: enable the hook and record in the run's ledger how each step's
    event pays for the count (the step events themselves stay the planned combined σ)."""
    sigma = optimizer.noise_multiplier
    hook = enable_adaptive_clipping(optimizer, target_quantile=target_quantile)
    ledger.append(
        "adaptive_clip",
        target_quantile=target_quantile,
        initial_clip=hook.state.clip,
        count_noise_std=hook.state.count_std,
        count_sensitivity=0.5,
        gradient_noise_multiplier=optimizer.noise_multiplier,
        step_noise_multiplier=sigma,
        note="per step, the clipped sum and the noisy count form one Gaussian of multiplier "
        "step_noise_multiplier on the same Poisson sample: each step record's event already charges it",
    )
    return hook
