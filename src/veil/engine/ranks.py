"""Training across ranks as the engine sees it: what ``make_private`` needs of a multi-process run.

The engine knows a run across ranks only through :class:`RankContext`: the checks it adds, the plan
agreement, the parameter broadcast, the sharded sampler and the all-reducing optimizer. Callers above
the engine may build one and pass it as ``make_private(distributed=context)``; the engine then uses it
as given. For ``distributed=None``/``True``/``False`` (the public keywords: a module wrapped in
``DistributedDataParallel``, or ``True`` under an initialised process group) :func:`resolve_ranks`
builds the torch.distributed one, :class:`veil.data_parallel.setup.DistributedSetup`, which lives at
the engine's own layer; a one-process run gets None and needs nothing from torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource
    from veil.plan import PrivacyPlan
    from veil.sampling import PoissonBatchSampler

__all__ = ["RankContext", "resolve_ranks"]


class RankContext(Protocol):
    """One rank's view of a data-parallel DP run, as ``make_private`` uses it (checks first, then builds).

    ``module``: the module this rank trains (the inner module of a DDP wrapper). ``check_sampling``,
    ``check_loader`` and ``agree`` refuse (``agree`` on every rank together); ``broadcast_parameters``,
    ``sampler``, ``optimizer_class`` and ``guard_wrapper`` build the run's pieces.
    """

    rank: int
    world_size: int
    module: nn.Module

    def check_sampling(self, sampling: str) -> None: ...

    def check_loader(self, data_loader: DataLoader) -> None: ...

    def agree(self, plan: PrivacyPlan) -> None: ...

    def broadcast_parameters(self) -> None: ...

    def sampler(
        self, dataset_size: int, sampling_rate: float, steps_per_epoch: int, rng: RandomSource
    ) -> PoissonBatchSampler: ...

    @property
    def optimizer_class(self) -> Any: ...

    def guard_wrapper(self) -> None: ...


def resolve_ranks(module: nn.Module, distributed: bool | RankContext | None) -> RankContext | None:
    """The run's :class:`RankContext`: the one passed in, the torch.distributed one, or None (one process).

    Anything but None, a bool or an object of the context's shape is refused by the torch.distributed
    resolver (the mode must be explicit). The shape is read from the object's type, so no property of
    the context runs before ``make_private`` uses it.
    """
    if distributed is not None and not isinstance(distributed, bool) and _has_context_shape(distributed):
        return distributed
    from veil.data_parallel.setup import resolve_setup

    mode: Any = distributed  # anything but None or a bool is refused there, by name
    return resolve_setup(module, mode)


_CONTEXT_MEMBERS = (
    "check_sampling",
    "check_loader",
    "agree",
    "broadcast_parameters",
    "sampler",
    "optimizer_class",
    "guard_wrapper",
)


def _has_context_shape(candidate: object) -> bool:
    kind = type(candidate)
    return all(hasattr(kind, name) for name in _CONTEXT_MEMBERS) and hasattr(candidate, "module")
