"""The one-run canary audit that ``veil train --audit`` attaches to its run (the audit package's hook;
training calls it, the audit never imports training).

:func:`run_one_run_audit` attaches white-box gradient canaries to an engine built elsewhere, right
after ``make_private``; :meth:`OneRunAudit.finish` gives the report section. :func:`train_audit`
is the call ``veil train`` makes with its configuration.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.audit.bounds import check_confidence
from veil.audit.canaries import GradientCanaries
from veil.audit.coordinates import Direction
from veil.audit.report import reading, verdict
from veil.errors import InvalidParameterError
from veil.pipeline.outputs import finite
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from torch import nn

    from veil.config import TrainConfig
    from veil.engine import PrivacyEngine
    from veil.optimizer import DPOptimizer

__all__ = ["OneRunAudit", "check_delta_room", "delta_cap", "run_one_run_audit", "train_audit"]


def delta_cap(delta: float) -> int:
    """The most canaries m with 2·m·δ < 1 (the automatic count stays below it)."""
    return max(1, math.ceil(1 / (2 * delta)) - 1) if delta > 0 else 10**9


def check_delta_room(canaries: int, delta: float) -> None:
    """The (ε, δ) one-run bound needs 2·m·δ < 1; refuse before training rather than after."""
    if canaries and 2 * canaries * delta >= 1:
        raise InvalidParameterError(
            "canaries",
            canaries,
            f"with δ = {delta:g}, 2·m·δ = {2 * canaries * delta:.3g} ≥ 1 makes the (ε, δ) one-run bound "
            "vacuous",
            f"pass --canaries < {math.ceil(1 / (2 * delta))} or a smaller --delta",
        )


class OneRunAudit:
    """Gradient canaries attached to a run built elsewhere; :meth:`finish` gives the report section."""

    def __init__(self, canaries: GradientCanaries, confidence: float) -> None:
        self.canaries = canaries
        self.confidence = confidence

    def finish(self, *, delta: float, epsilon_theoretical: float | None) -> dict[str, Any]:
        """Stop injecting and return ``{epsilon_lower_bound, confidence, epsilon_theoretical, ...}``."""
        self.canaries.detach()
        b = self.canaries.bound(self.confidence, delta=delta)
        theo = (
            None
            if epsilon_theoretical is None or not math.isfinite(epsilon_theoretical)
            else epsilon_theoretical
        )
        return finite(
            {
                "epsilon_lower_bound": b.epsilon,
                "confidence": self.confidence,
                "epsilon_theoretical": theo,
                "delta": delta,
                "verdict": verdict(b.epsilon, theo),
                "reading": reading(b.epsilon, theo, self.confidence, delta, None),
                "canaries": {
                    "count": self.canaries.count,
                    "gradient": {**self.canaries.summary(), "bound": b.to_dict()},
                },
            }
        )


def run_one_run_audit(
    model: nn.Module,
    optimizer: DPOptimizer,
    engine: PrivacyEngine,
    sample: tuple[np.ndarray, np.ndarray],
    *,
    canaries: int | None = None,
    confidence: float = 0.95,
    direction: Direction = "dirac",
    seed: int | None = None,
    secure_rng: bool = False,
    delta: float | None = None,
) -> OneRunAudit:
    """Attach white-box gradient canaries to a private run; call right after ``make_private``.

    ``sample``: a few training examples (inputs as the model takes them, labels) to find the quiet
    coordinates; ``delta`` (the run's δ), when given, is checked to leave the bound room (2mδ < 1)
    before the run starts. The canaries do not touch the data, the sampling or the noise of the real examples,
    so the run's guarantee for them is unchanged; the released weights do carry the canaries' pushes
    on their (quiet) coordinates. Returns an :class:`OneRunAudit`; after the last step call
    ``finish(delta=δ, epsilon_theoretical=ε)`` for the report section.
    """
    from veil.mechanisms.rng import make_source

    conf = check_confidence(confidence)
    if engine.plan is None or engine.sampling_rate is None:
        raise InvalidParameterError(
            "engine", "not private yet", "canaries join the run's Poisson sampling", "call make_private first"
        )
    if engine.plan.sampling != "poisson":
        raise InvalidParameterError(
            "sampling",
            engine.plan.sampling,
            "a canary must be sampled exactly like a record, which the audit does for Poisson sampling only",
            "audit a Poisson-sampled run",
        )
    rng = make_source(secure_rng, None if secure_rng or seed is None else derive_seed(seed, Purpose.AUDIT))
    design = GradientCanaries.design(
        model,
        canaries,
        rng=rng,
        max_grad_norm=float(engine.plan.max_grad_norm),
        direction=direction,
        sample=sample,
        expected_batch_size=optimizer.expected_batch_size,
        noise_multiplier=optimizer.noise_multiplier,
        cap=None if delta is None else delta_cap(delta),
    )
    if delta is not None:
        check_delta_room(design.count, delta)
    design.attach(optimizer, sampling_rate=float(engine.sampling_rate))
    return OneRunAudit(design, conf)


def train_audit(
    cfg: TrainConfig, model: nn.Module, optimizer: DPOptimizer, engine: PrivacyEngine, x: np.ndarray
) -> OneRunAudit:
    """``veil train --audit``: gradient canaries with the run's settings. Placed on random coordinates,
    so that placing them needs no private data (an empty sample of ``x``'s shape)."""
    return run_one_run_audit(
        model,
        optimizer,
        engine,
        (x[:0], np.zeros(0, dtype=np.int64)),
        canaries=cfg.audit_canaries,
        confidence=cfg.audit_confidence,
        seed=None if cfg.secure_rng else cfg.seed,
        secure_rng=cfg.secure_rng,
        delta=cfg.delta,
    )
