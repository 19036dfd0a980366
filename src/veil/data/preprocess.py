"""Preprocessing of private features: public scaling, or DP estimates paid for from the budget.

Guarantee. The preprocessing applied before a model sees the private training data is one of:

* ``pixels`` — images: ``x / pixel_max`` (into [0, 1]) with the format's documented maximum (255 for
  IDX bytes, 16 for scikit-learn's digits). Public; no privacy cost.
* ``as-given`` — images of unknown range (float npz): used unchanged. Public; no privacy cost.
* ``bounds`` — tables with ``feature_bounds`` declared by the user: clip each feature to its public
  ``[low, high]`` and map it linearly onto ``[-1, 1]``. Public; no privacy cost.
* ``schema`` — tables read through a reviewed schema (:mod:`veil.tables`): already encoded by public
  declarations (levels, bounds, missing-value indicators); used as given. Public; no privacy cost.
* ``dp-center`` — tables without declared bounds: a public per-value transform
  ``t(x) = asinh(x/r) − asinh(1/r)`` (``r = feature_resolution``: log-like for |x| ≫ r, so that
  features on any scale land on a few units, with x = 1 at 0), then a **DP estimate of the mean of
  t(x)**, subtracted from every example. Mechanism: each training row's transformed vector is clipped
  to L2 norm ``R`` (``center_clip_norm``, default 5·√d), the clipped rows are summed and the
  Gaussian mechanism adds ``N(0, (σ_pre·R)²)`` to each coordinate. Under add/remove-one
  neighbouring the clipped sum has L2 sensitivity R, so the release is the event ``Gaussian(σ_pre)``
  (lattice-corrected in secure mode, see :mod:`veil.mechanisms.gaussian`); the mean divides by N,
  treated as public as in DP-SGD's q = B/N. ``σ_pre`` is the analytic-Gaussian σ whose single release
  costs ``preprocessing_budget · ε``; the event is composed with the training steps in the same
  accountant and the training σ is calibrated for what remains.

No mean, standard deviation, min, max or quantile of the private data is ever computed without one
of these events. The test split is transformed with the same (already released) parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from veil.accounting.events import PrivacyEvent
from veil.data.rows import flat_rows
from veil.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from veil.data import Dataset
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "PreprocessingPlan",
    "PreprocessingSettings",
    "build_transform",
    "plan_preprocessing",
    "run_preprocessing",
    "transform_numpy",
]

Method = Literal["pixels", "as-given", "bounds", "dp-center", "schema", "tokens"]


class PreprocessingSettings(Protocol):
    """The settings preprocessing reads (a :class:`~veil.config.TrainConfig` has them all); passed
    as values so that this module never depends on the configuration layer above it."""

    @property
    def feature_bounds(self) -> Sequence[Sequence[float]] | Mapping[str, Sequence[float]] | None: ...
    @property
    def center_clip_norm(self) -> float | None: ...
    @property
    def preprocessing_budget(self) -> float: ...
    @property
    def feature_resolution(self) -> float: ...
    @property
    def epsilon(self) -> float: ...
    @property
    def delta(self) -> float: ...
    @property
    def secure_rng(self) -> bool: ...


@dataclass
class PreprocessingPlan:
    """What will be done to the features, decided before any private statistic is released."""

    method: Method
    description: str
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    offset: np.ndarray | float = 0.0
    scale: np.ndarray | float = 1.0
    resolution: float = 0.0
    clip_norm: float | None = None
    sigma: float | None = None
    event: PrivacyEvent | None = None
    released: dict[str, Any] = field(default_factory=dict)

    @property
    def public(self) -> bool:
        return self.event is None


def _bounds_arrays(config: PreprocessingSettings, dataset: Dataset) -> tuple[np.ndarray, np.ndarray]:
    d = dataset.input_shape[0]
    bounds = config.feature_bounds
    assert bounds is not None
    if isinstance(bounds, Mapping):
        names = dataset.feature_names or []
        unknown = [k for k in bounds if k not in names]
        if unknown:
            raise ConfigError(
                "feature_bounds",
                unknown[0],
                "no feature has this name",
                f"use the feature names: {', '.join(names[:20])}",
            )
        missing = [n for n in names if n not in bounds]
        if missing:
            raise ConfigError(
                "feature_bounds",
                f"{len(missing)} feature(s) without bounds (first: {missing[0]})",
                "a feature without public bounds would need a private statistic to be scaled",
                "declare [low, high] for every feature, or give no bounds to use the DP centring",
            )
        pairs = [bounds[n] for n in names]
    elif len(bounds) == 1:
        pairs = list(bounds) * d
    elif len(bounds) == d:
        pairs = list(bounds)
    else:
        raise ConfigError(
            "feature_bounds",
            f"{len(bounds)} pairs",
            f"the data has {d} features",
            "give one [low, high] pair per feature, or one for all",
        )
    arr = np.asarray(pairs, dtype=np.float64)
    return arr[:, 0], arr[:, 1]


def plan_preprocessing(config: PreprocessingSettings, dataset: Dataset) -> PreprocessingPlan:
    """Choose the preprocessing and, for ``dp-center``, its noise and planned privacy event."""
    if dataset.kind == "text":
        return PreprocessingPlan("tokens", "token ids from the model's own tokenizer (public), used as given")
    if dataset.kind == "image":
        if dataset.pixel_max:
            pm = float(dataset.pixel_max)
            return PreprocessingPlan(
                "pixels", f"pixels / {pm:g} (the format's documented range) into [0, 1]", scale=1 / pm
            )
        return PreprocessingPlan("as-given", "image values used as given")
    if dataset.encoder is not None:
        if config.feature_bounds is not None:
            raise ConfigError(
                "feature_bounds",
                "given with a schema",
                "the schema already declares each column's public bounds; two declarations could disagree",
                "declare the bounds in the schema only",
            )
        schema = dataset.encoder.schema
        if schema.reviewed == "dp":
            source = (
                f"released with DP by veil schema infer (ε = {schema.dp.get('epsilon', '?')}, "
                f"δ = {schema.dp.get('delta', '?')}, charged to the dataset apart from this run's ε)"
            )
        else:
            source = "declared public by its reviewer (reviewed = true)"
        return PreprocessingPlan(
            "schema",
            f"features encoded by the table's schema, {source}: levels one-hot or embedded, numeric "
            "values clipped to the declared bounds and scaled to [-1, 1], missing values as indicators",
        )
    if config.feature_bounds is not None:
        lo, hi = _bounds_arrays(config, dataset)
        return PreprocessingPlan(
            "bounds",
            "features clipped to the declared public bounds and scaled to [-1, 1]",
            lo=lo,
            hi=hi,
            offset=(lo + hi) / 2,
            scale=2 / (hi - lo),
        )
    from veil.mechanisms.gaussian import gaussian_mechanism, gaussian_std_analytic
    from veil.mechanisms.rng import make_source

    d = int(np.prod(dataset.input_shape))
    clip = config.center_clip_norm or 5.0 * math.sqrt(d)
    sigma = gaussian_std_analytic(config.preprocessing_budget * config.epsilon, config.delta, 1.0)
    # The event depends only on (σ, R, d, secure or not): read it off a dry run on zeros.
    dry = gaussian_mechanism(
        np.zeros(d),
        sensitivity=clip,
        std=sigma * clip,
        rng=make_source(config.secure_rng, None if config.secure_rng else 0),
    )
    return PreprocessingPlan(
        "dp-center",
        f"asinh(x/{config.feature_resolution:g}) − asinh(1/{config.feature_resolution:g}) per feature, "
        "centred by a DP mean (rows clipped to L2 norm "
        f"{clip:.4g}, Gaussian noise σ = {sigma:.4g}·{clip:.4g})",
        resolution=config.feature_resolution,
        clip_norm=clip,
        sigma=sigma,
        event=dry.event,
    )


def transform_numpy(plan: PreprocessingPlan, x: np.ndarray) -> np.ndarray:
    """The plan's transform in numpy float64 (the same as :func:`build_transform`'s module)."""
    z = np.asarray(x, dtype=np.float64)
    if plan.lo is not None and plan.hi is not None:
        z = np.clip(z, plan.lo, plan.hi)
    if plan.resolution > 0:
        r = plan.resolution
        z = np.arcsinh(z / r) - math.asinh(1 / r)
    return (z - plan.offset) * plan.scale


def run_preprocessing(
    plan: PreprocessingPlan, dataset: Dataset, rng: RandomSource, count: int | None = None
) -> PreprocessingPlan:
    """Release the plan's DP statistic (call only after its event is in the ledger).

    The DP centre is the noisy clipped sum divided by ``count``, a public number: the training rows'
    N where N is public (``veil train``), else a size fixed before reading (``veil tune``'s part:
    ⌊(1 − F)·N⌋). Dividing by a private count would make the released centre move by up to twice
    the accounted sensitivity between neighbours. None: ``dataset.n_train``. Any number of training
    rows, 0 included (an empty trial part is private), gives a release: the rows are flattened to the
    public example shape, never to a size inferred from the data."""
    if plan.method != "dp-center":
        return plan
    from veil.mechanisms.gaussian import gaussian_mechanism

    assert plan.clip_norm is not None and plan.sigma is not None
    z = transform_numpy(plan, flat_rows(dataset.x_train, dataset.input_shape))
    norms = np.linalg.norm(z, axis=1)
    factor = np.minimum(1.0, plan.clip_norm / np.maximum(norms, 1e-300))
    # per-record rule: a row whose transformed vector is not finite adds zero (not NaN to everyone)
    finite = np.isfinite(norms)
    total = np.where(finite[:, None], z * np.where(finite, factor, 0.0)[:, None], 0.0).sum(axis=0)
    result = gaussian_mechanism(total, sensitivity=plan.clip_norm, std=plan.sigma * plan.clip_norm, rng=rng)
    if result.event != plan.event:  # pragma: no cover - the dry run fixes it
        raise RuntimeError(f"released event {result.event} differs from the accounted {plan.event}")
    center = np.asarray(result.value, dtype=np.float64) / (dataset.n_train if count is None else count)
    plan.offset = center
    plan.released = {"center": center.tolist()}
    return plan


def restore_preprocessing(plan: PreprocessingPlan, released: dict[str, Any]) -> PreprocessingPlan:
    """Reuse a statistic released earlier in this run (resume): no new release, no new cost."""
    if plan.method == "dp-center":
        plan.offset = np.asarray(released["center"], dtype=np.float64)
        plan.released = dict(released)
    return plan


def build_transform(plan: PreprocessingPlan, input_shape: tuple[int, ...]) -> nn.Module:
    """The plan as the first layer of the model (buffers only, nothing trainable)."""
    import torch

    from veil.models import InputTransform

    if plan.method == "tokens":
        return torch.nn.Identity()

    def t(v: np.ndarray | float | None, default: float) -> torch.Tensor:
        if v is None:
            return torch.full(input_shape, default, dtype=torch.float32)
        return torch.as_tensor(
            np.broadcast_to(np.asarray(v, dtype=np.float64), input_shape).copy(), dtype=torch.float32
        )

    return InputTransform(
        lo=t(plan.lo, -math.inf),
        hi=t(plan.hi, math.inf),
        offset=t(plan.offset, 0.0),
        scale=t(plan.scale, 1.0),
        resolution=plan.resolution,
    )
