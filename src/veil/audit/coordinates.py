"""Where gradient canaries go, chosen before training from the data and the model, never from the
canary bits (so the choice cannot bias the audit; see :mod:`veil.audit.canaries`): each
coordinate's clipped-gradient activity on a sample of training examples at initialisation, the
quietest coordinates, and how many canaries the model allows and the automatic count uses."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.mechanisms.rng import RandomSource

__all__ = [
    "AUTO_CANARIES",
    "Direction",
    "auto_canary_count",
    "coordinate_activity",
    "hook_free_copy",
    "max_gradient_canaries",
    "quiet_coordinates",
    "trainable_parameters",
]

Direction = Literal["dirac", "random"]
_RANDOM_MAX_FLOATS = 50_000_000  # m·d floats kept for random-direction canaries (200 MB float32)
_ACTIVITY_SAMPLE = 64


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def max_gradient_canaries(model: nn.Module, direction: Direction = "dirac") -> int:
    """Most gradient canaries a model allows: one coordinate each (Dirac), or m·d within memory."""
    d = sum(p.numel() for p in trainable_parameters(model))
    if direction == "dirac":
        return d
    return max(1, min(d, _RANDOM_MAX_FLOATS // max(d, 1)))


def hook_free_copy(model: nn.Module) -> nn.Module:
    """A deep copy with every module hook dropped (e.g. a clipper's), for side measurements."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for name, value in list(vars(module).items()):
            if "hooks" in name and isinstance(value, dict):
                value.clear()
    return twin


def coordinate_activity(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, max_grad_norm: float, rng: RandomSource
) -> np.ndarray:
    """Per flat coordinate j (over trainable parameters): mean of ``|clip_C(g_n)_j|`` over up to 64
    training examples at the current weights (cross-entropy loss, hook-free copy in eval mode).

    Uses the data, never the canary bits, so choosing canaries by it cannot bias the audit.
    """
    import torch

    twin = hook_free_copy(model).eval()
    n = min(len(x), _ACTIVITY_SAMPLE)
    pick = np.sort(np.argsort(rng.uniform(len(x)), kind="stable")[:n])
    xs, ys = torch.as_tensor(x[pick]), torch.as_tensor(y[pick]).long()
    try:
        per = _per_example_vmap(twin, xs, ys)
    except Exception:  # a model torch.func cannot batch: one backward pass per example
        per = _per_example_loop(twin, xs, ys)
    per = per.double()
    factor = torch.clamp(max_grad_norm / per.norm(dim=1).clamp_min(1e-300), max=1.0)
    return np.asarray((per.abs() * factor[:, None]).mean(dim=0).numpy())


def _per_example_vmap(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    values = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    others = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    others.update(dict(model.named_buffers()))

    def one(vals: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**vals, **others}, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    grads = vmap(grad(one), in_dims=(None, 0, 0))(values, xs, ys)
    return torch.cat([grads[name].reshape(len(xs), values[name].numel()) for name in names], dim=1)


def _per_example_loop(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    params = trainable_parameters(model)
    rows = []
    for i in range(len(xs)):
        loss = F.cross_entropy(model(xs[i : i + 1]), ys[i : i + 1])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).detach().reshape(-1)
                    for g, p in zip(grads, params, strict=True)
                ]
            )
        )
    return torch.stack(rows)


def quiet_coordinates(activity: np.ndarray, count: int, *, rng: RandomSource) -> np.ndarray:
    """The ``count`` coordinates with the least activity, ties (e.g. dead inputs) broken at random."""
    jitter = rng.uniform(activity.size)
    order = np.lexsort((jitter, np.asarray(activity, dtype=np.float64)))  # by activity, then at random
    return np.asarray(order[:count], dtype=np.int64)


AUTO_CANARIES = 2000


def auto_canary_count(
    activity: np.ndarray,
    *,
    expected_batch_size: int,
    max_grad_norm: float,
    noise_multiplier: float,
    limit: int,
) -> int:
    """How many Dirac canaries to use when none is asked for: as many as the model allows, up to
    :data:`AUTO_CANARIES`.

    The scores subtract the real data's clipped sum (see :class:`GradientCanaries`), so a canary's
    score carries only its own signal and the noise, whatever its coordinate's activity: each
    Dirac canary (a coordinate of its own) adds evidence without interfering with the others, and
    the one-run bound only tightens with more of them (at σ = 0, all guessed right: 2.9 for 100,
    5.2 for 1000, 6.3 for 3000 at 95 %). ``activity``, ``expected_batch_size``, ``max_grad_norm``
    and ``noise_multiplier`` are accepted for callers of the earlier, drift-limited rule."""
    del activity, expected_batch_size, max_grad_norm, noise_multiplier
    return int(max(1, min(AUTO_CANARIES, limit)))
