"""Canaries for one-run audits: white-box gradient canaries and black-box input canaries.

Every canary is included in the run independently with probability ½ (its bit ``S_i``, drawn from
a :class:`~veil.mechanisms.rng.RandomSource` that nothing else in the run reads). After training each
canary gets a score (higher = "more likely included") and :func:`veil.audit.bounds.bound_from_scores`
turns the scores into an ε lower bound at a stated confidence. Soundness does not depend on how good
the scores are, only on (i) the bits being independent fair coins fixed before training, (ii) the
canary design (which coordinates, which examples) being chosen without looking at the bits, and (iii)
each canary being a *valid record* for the audited guarantee, which is checked here:

**Gradient canaries** (:class:`GradientCanaries`, white box). Canary ``i`` is a record whose clipped
gradient is the fixed vector ``c_i`` with ``‖c_i‖ = C`` exactly (the clip norm, flat clipping), and
which, like every record under Poisson sampling, joins each logical step independently with the
run's sampling rate q. For an included canary drawn into a step, ``c_i / B`` is added to the released
gradient — the same as adding ``c_i`` to the clipped sum before the noise, since the noise is
additive and independent. DP-SGD's (ε, δ) under add/remove-one holds for any per-record gradients of
norm ≤ C, so each canary enjoys exactly the guarantee a real example does, and the real examples'
guarantee is unchanged (their sampling, sensitivity and noise are untouched). ``c_i`` is either a
*Dirac* gradient ``±C·e_j`` on a coordinate of its own (default: the coordinates where the data's
clipped gradients are smallest at initialisation, measured on a sample of the training data before
training, and by default only as many as are quiet enough to help, see :func:`auto_canary_count` —
design choices that look at the data and σ but never at the bits), or a random unit direction
times C. The auditor observes every released gradient (what DP-SGD's accounting covers: all iterates)
and, white box, the real records' clipped sum ``S_t`` of each step (read from the clipper before the
step ends). It scores canary i by the normalised projections of the release minus the data,
``x_t = B⟨ĝ_t − S_t/B, c_i⟩ / C²`` (1 per inclusion plus noise, no data drift): their sum, or,
when σ > 0, the per-step likelihood ratio of the Poisson-subsampled Gaussian,
``Σ_t log(1 − q + q·exp((2x_t − 1) / (2σ²)))``. Subtracting ``S_t`` keeps the audit sound: ``S_t``
is a function of the real data, their Poisson draws (independent of the canary bits) and the
current weights (a post-processing of earlier releases), and DP-SGD's guarantee for each canary
holds against an adversary who knows all of these. It is what gives the audit its power: at σ = 0
every score is exactly its number of inclusions, so the bound is limited only by the number of
canaries (:func:`auto_canary_count`).

**Input canaries** (:class:`InputCanaries`, black box). Held-out examples given a wrong label,
included in the training set with probability ½ and scored by the logit-scaled confidence of the
wrong label under the final model. They are records like any other: each is audited under the
run's add/remove-one guarantee. (To keep the sampling rate independent of the bits, an excluded
canary stays in the dataset with weight 0, i.e. it contributes an exactly zero gradient.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from veil.audit.bounds import OneRunBound, bound_from_scores
from veil.audit.coordinates import (
    Direction,
    auto_canary_count,
    coordinate_activity,
    max_gradient_canaries,
    quiet_coordinates,
    trainable_parameters,
)
from veil.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from veil.mechanisms.rng import RandomSource
    from veil.optimizer import DPOptimizer

__all__ = ["GradientCanaries", "ScoreKind", "check_count"]

ScoreKind = Literal["sum", "likelihood"]


def check_count(name: str, value: Any) -> int:
    """A canary count: an int ≥ 1 (a bool, float or smaller value refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidParameterError(name, value, "it counts canaries", "pass an integer ≥ 1")
    return int(value)


class GradientCanaries:
    """White-box gradient canaries for a DP-SGD run (see the module docstring for the guarantee).

    Use: ``canaries = GradientCanaries.design(model, m, rng=..., sample=(x, y), max_grad_norm=C)``,
    then after ``make_private``: ``canaries.attach(dp_optimizer, sampling_rate=engine.sampling_rate)``;
    train as usual; then ``canaries.bound(confidence, delta=δ)``. ``detach()`` stops the injection.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        direction: Direction,
        included: np.ndarray,
        rng: RandomSource,
        coordinates: np.ndarray | None = None,
        signs: np.ndarray | None = None,
        directions: torch.Tensor | None = None,
    ) -> None:
        self.params = params
        self.direction: Direction = direction
        self.included = np.asarray(included, dtype=bool)
        self.count = int(self.included.size)
        self.rng = rng
        self.coordinates = coordinates
        self.signs = signs
        self.directions = directions  # [m, d] float32 unit rows (random) or None
        self.sizes = [p.numel() for p in params]
        self.dimension = int(sum(self.sizes))
        self.steps = 0
        self.inclusions = np.zeros(self.count, dtype=np.int64)
        self.last_drawn = np.zeros(self.count, dtype=bool)
        self.sum_scores = np.zeros(self.count)
        self.likelihood_scores = np.zeros(self.count)
        self.max_grad_norm: float | None = None
        self.sampling_rate: float | None = None
        self.noise_multiplier: float | None = None
        self.expected_batch_size: int | None = None
        self._handle: RemovableHandle | None = None
        self._blocks: list[tuple[int, Any, np.ndarray]] = []
        self._clipper: Any = None
        self._sum_index: list[int] = []

    # -- design --------------------------------------------------------------------------------
    @classmethod
    def design(
        cls,
        model: nn.Module,
        count: int | None,
        *,
        rng: RandomSource,
        max_grad_norm: float,
        direction: Direction = "dirac",
        sample: tuple[np.ndarray, np.ndarray] | None = None,
        expected_batch_size: int | None = None,
        noise_multiplier: float = 0.0,
        cap: int | None = None,
    ) -> GradientCanaries:
        """Choose the canaries and their inclusion bits (Bernoulli(½) each).

        Dirac canaries take the quietest coordinates on ``sample`` (training examples, see
        :func:`coordinate_activity`), or uniformly random coordinates without a sample. ``count=None``
        picks :func:`auto_canary_count` (Dirac with a sample and ``expected_batch_size``), else
        ``min(1000, limit / 2)``; an automatic count is kept ≤ ``cap``. Raises
        :class:`~veil.errors.InvalidParameterError` when the model has too few parameters for
        ``count`` canaries.
        """
        import torch

        if direction not in ("dirac", "random"):
            raise InvalidParameterError(
                "canary_direction", direction, "unknown canary kind", "use 'dirac' or 'random'"
            )
        params = trainable_parameters(model)
        d = sum(p.numel() for p in params)
        limit = max_gradient_canaries(model, direction)
        activity = None
        if direction == "dirac" and sample is not None and len(sample[0]) > 0:
            activity = coordinate_activity(model, sample[0], sample[1], max_grad_norm=max_grad_norm, rng=rng)
        if count is None:
            if activity is not None and expected_batch_size is not None:
                count = auto_canary_count(
                    activity,
                    expected_batch_size=expected_batch_size,
                    max_grad_norm=max_grad_norm,
                    noise_multiplier=noise_multiplier,
                    limit=limit,
                )
            else:
                count = max(1, min(1000, limit // 2))
            if cap is not None:
                count = max(1, min(count, cap))
        count = check_count("canaries", count)
        if count > limit:
            what = (
                f"the model has {d} trainable parameters and each Dirac canary needs a coordinate of its own"
                if direction == "dirac"
                else f"{count} random directions of dimension {d} do not fit in memory"
            )
            raise InvalidParameterError(
                "canaries",
                count,
                what + "; more canaries than that would interfere",
                f"pass --canaries ≤ {limit}",
            )
        included = rng.bernoulli(count, 0.5)
        if direction == "dirac":
            if activity is not None:
                coords = quiet_coordinates(activity, count, rng=rng)
            else:
                coords = np.argsort(rng.uniform(d), kind="stable")[:count].astype(np.int64)
            signs = np.where(rng.bernoulli(count, 0.5), 1.0, -1.0)
            return cls(params, direction="dirac", included=included, rng=rng, coordinates=coords, signs=signs)
        gauss = rng.standard_normal((count, d))
        gauss /= np.linalg.norm(gauss, axis=1, keepdims=True)
        directions = torch.from_numpy(gauss.astype(np.float32))
        return cls(params, direction="random", included=included, rng=rng, directions=directions)

    def vectors(self) -> np.ndarray:
        """The canary gradients ``c_i`` as ``[m, d]`` float64 (norm C each; needs :meth:`attach`)."""
        c = self._norm()
        out = np.zeros((self.count, self.dimension))
        if self.direction == "dirac":
            assert self.coordinates is not None and self.signs is not None
            out[np.arange(self.count), self.coordinates] = self.signs * c
        else:
            assert self.directions is not None
            out[:] = self.directions.double().numpy() * c
        return out

    def _norm(self) -> float:
        if self.max_grad_norm is None:
            raise InvalidParameterError(
                "canaries", "not attached", "the canary norm is the run's clip norm", "call attach() first"
            )
        return self.max_grad_norm

    # -- injection -----------------------------------------------------------------------------
    def attach(self, optimizer: DPOptimizer, *, sampling_rate: float) -> None:
        """Inject into ``optimizer`` (a veil ``DPOptimizer``) from its next logical step on.

        A step pre-hook on the wrapped torch optimizer runs right after the private gradient is
        written (clipped sum + noise, divided by B) and before the user's update: it adds ``c_i / B``
        for each included canary drawn into this step (probability ``sampling_rate``) and records
        the projections of the released gradient on every canary.
        """
        import torch

        original = getattr(optimizer, "original_optimizer", None)
        clipper = getattr(optimizer, "clipper", None)
        if original is None or clipper is None:
            raise InvalidParameterError(
                "optimizer",
                type(optimizer).__name__,
                "gradient canaries go into the clipped sum of veil's DP optimizer",
                "pass the optimizer returned by PrivacyEngine.make_private",
            )
        if len(clipper.max_grad_norms) != 1:
            raise InvalidParameterError(
                "clipping",
                "per_layer",
                "a gradient canary of norm C is a valid record only under flat clipping",
                "audit a run with flat clipping",
            )
        if {id(p) for p in clipper.parameters} != {id(p) for p in self.params}:
            raise InvalidParameterError(
                "optimizer",
                "other parameters",
                "the canaries were designed on a model whose parameters this optimizer does not privatise",
                "design the canaries on the model passed to make_private",
            )
        q = float(sampling_rate)
        if not 0 < q <= 1:
            raise InvalidParameterError(
                "sampling_rate", q, "a Poisson rate lies in (0, 1]", "pass engine.sampling_rate"
            )
        if self._handle is not None:
            raise InvalidParameterError(
                "canaries", "attached", "canaries are injected into one run only", "design new canaries"
            )
        self._clipper = clipper
        optimizer.keep_clipped_sum = True  # the hook below reads Σ clip(g_i) after the release
        position = {id(p): i for i, p in enumerate(clipper.parameters)}
        self._sum_index = [position[id(p)] for p in self.params]
        self.max_grad_norm = float(optimizer.max_grad_norm)
        self.noise_multiplier = float(optimizer.noise_multiplier)
        self.expected_batch_size = int(optimizer.expected_batch_size)
        self.sampling_rate = q
        if self.direction == "dirac":
            assert self.coordinates is not None
            offsets = np.cumsum([0, *self.sizes])
            self._blocks = []
            for k in range(len(self.params)):
                ids = np.flatnonzero((self.coordinates >= offsets[k]) & (self.coordinates < offsets[k + 1]))
                if ids.size:
                    local = torch.as_tensor(self.coordinates[ids] - offsets[k], dtype=torch.long)
                    self._blocks.append((k, local, ids))
        self._handle = original.register_step_pre_hook(self._hook)

    def detach(self) -> None:
        """Stop injecting (the recorded scores are kept)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        assert self.max_grad_norm is not None and self.sampling_rate is not None
        assert self.expected_batch_size is not None
        c, b = self.max_grad_norm, float(self.expected_batch_size)
        drawn = self.included & self.rng.bernoulli(self.count, self.sampling_rate)
        self.last_drawn = drawn
        self.inclusions += drawn
        x = np.zeros(self.count)
        # The real records' clipped sum of this step (the clipper keeps it until the step ends):
        # the auditor subtracts it, so a score sees only its canary and the noise.
        sums = self._clipper.clipped_sum() if self._clipper is not None else None
        with torch.no_grad():
            if self.direction == "dirac":
                assert self.signs is not None
                for k, local, ids in self._blocks:
                    p = self.params[k]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    if not p.grad.is_contiguous():
                        p.grad = p.grad.contiguous()
                    flat = p.grad.view(-1)
                    add = self.signs[ids] * drawn[ids] * (c / b)
                    flat.index_add_(
                        0, local.to(flat.device), torch.as_tensor(add, dtype=flat.dtype, device=flat.device)
                    )
                    released = flat.index_select(0, local.to(flat.device)).to("cpu", torch.float64).numpy()
                    if sums is not None:
                        data = sums[self._sum_index[k]].reshape(-1).index_select(0, local.to(flat.device))
                        released = released - data.to("cpu", torch.float64).numpy() / b
                    x[ids] = b * self.signs[ids] * released / c
            else:
                assert self.directions is not None
                u = self.directions
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                add = (c / b) * (torch.as_tensor(drawn, dtype=u.dtype) @ u)
                offset = 0
                parts: list[torch.Tensor] = []
                for k, (p, size) in enumerate(zip(self.params, self.sizes, strict=True)):
                    assert p.grad is not None
                    p.grad.add_(add[offset : offset + size].view_as(p).to(p.grad.device, p.grad.dtype))
                    part = p.grad.detach().reshape(-1).to("cpu", torch.float64)
                    if sums is not None:
                        part = part - sums[self._sum_index[k]].reshape(-1).to("cpu", torch.float64) / b
                    parts.append(part.to(u.dtype))
                    offset += size
                x = b * (u @ torch.cat(parts)).double().numpy() / c
        self.steps += 1
        self.sum_scores += x
        sigma = self.noise_multiplier or 0.0
        if sigma > 0:
            q = self.sampling_rate
            log_out = math.log1p(-q) if q < 1 else -math.inf
            self.likelihood_scores += np.logaddexp(log_out, math.log(q) + (2 * x - 1) / (2 * sigma**2))

    # -- scoring -------------------------------------------------------------------------------
    @property
    def score_kind(self) -> ScoreKind:
        """``likelihood`` when the run adds noise (σ > 0), else ``sum``; fixed before training."""
        return "likelihood" if (self.noise_multiplier or 0.0) > 0 else "sum"

    def scores(self) -> np.ndarray:
        """One score per canary (higher = more likely included)."""
        return (self.likelihood_scores if self.score_kind == "likelihood" else self.sum_scores).copy()

    def bound(self, confidence: float = 0.95, *, delta: float = 0.0, share: int = 1) -> OneRunBound:
        """The one-run ε lower bound from these canaries (see :func:`bound_from_scores`)."""
        if self.steps == 0:
            raise InvalidParameterError(
                "canaries",
                "no step",
                "no training step ran with the canaries attached",
                "train after attach()",
            )
        # Without noise a score counts its canary's inclusions exactly (the data is subtracted),
        # so "included iff score > 0.5" is a fixed rule that guesses every canary.
        threshold = 0.5 if self.score_kind == "sum" and self.direction == "dirac" else None
        return bound_from_scores(
            self.scores(), self.included, confidence=confidence, delta=delta, share=share, threshold=threshold
        )

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "gradient",
            "direction": self.direction,
            "count": self.count,
            "included": int(self.included.sum()),
            "score": self.score_kind,
            "steps": self.steps,
            "mean_inclusions_per_included_canary": float(self.inclusions[self.included].mean())
            if self.included.any()
            else 0.0,
        }
