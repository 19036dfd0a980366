"""What ``PrivacyEngine.make_private`` needs to train across ranks: the checks and the pieces it builds.

``make_private`` calls :func:`resolve_setup` first. On a module wrapped in
``torch.nn.parallel.DistributedDataParallel`` (or with ``distributed=True``) it returns a
:class:`DistributedSetup`; the engine then trains the **inner** module and returns it as the model.

Why the inner module. DDP all-reduces ``p.grad`` during ``backward()``: averaged *unclipped*
gradients, which DP-SGD must never form (and veil's clipper never materialises that gradient, so
DDP's reducer would also wait for gradients that never come). veil instead all-reduces the clipped
sums once per logical step (:class:`~veil.data_parallel.optimizer.DistributedDPOptimizer`). The DDP
wrapper is guarded: a forward through it that could record gradients raises
:class:`~veil.errors.ConfigError` naming the fix, so its averaging never sees a gradient.

What the setup checks and does, in ``make_private``'s order (checks first, changes after):

* ``torch.distributed`` is initialised (any backend: gloo on CPU, NCCL on GPU);
* sampling is Poisson (the opt-in shuffled loader has no sharded form), and the data loader is a plain
  loader over the whole dataset (a ``DistributedSampler`` would silently change the sampling rate the
  accountant uses);
* every rank built the same :class:`~veil.plan.PrivacyPlan` (σ, C, q, B, N, ...): one
  ``all_gather_object``; a mismatch is refused on every rank at once;
* then rank 0's parameters and buffers are broadcast to every rank, so replicas start identical.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.hooks import RemovableHandle

from veil.data_parallel.optimizer import DistributedDPOptimizer
from veil.data_parallel.sampler import ShardedPoissonBatchSampler
from veil.errors import ConfigError, SamplingError

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource
    from veil.plan import PrivacyPlan

__all__ = ["DistributedSetup", "resolve_setup"]


@dataclass
class DistributedSetup:
    """One rank's view of a data-parallel DP run: its rank, the group, the module it trains."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    module: nn.Module
    wrapper: DistributedDataParallel | None = None
    _guard: RemovableHandle | None = field(default=None, repr=False)

    # -- checks (nothing changes) ----------------------------------------------------------------
    def check_loader(self, data_loader: DataLoader) -> None:
        """Refuse a loader that already shards the data: veil shards the Poisson sampling itself."""
        if isinstance(data_loader.sampler, DistributedSampler) or isinstance(
            getattr(data_loader.batch_sampler, "sampler", None), DistributedSampler
        ):
            raise SamplingError(
                "data_loader.sampler",
                "DistributedSampler",
                "each rank would see 1/W of the data with its own batch size, so the sampling rate the "
                "accountant assumes (q = batch_size / N) would not be the one used",
                "pass a plain DataLoader over the whole dataset with batch_size = the global expected "
                "batch size; veil gives each rank its shard of every Poisson-sampled batch",
            )

    def check_sampling(self, sampling: str) -> None:
        if sampling != "poisson":
            raise SamplingError(
                "poisson_sampling",
                False,
                "distributed training shards Poisson-sampled batches across ranks; fixed-size shuffled "
                "batches have no sharded form whose accounting veil can state",
                "keep poisson_sampling=True",
            )

    def agree(self, plan: PrivacyPlan) -> None:
        """Refuse (on every rank) unless every rank built the same privacy plan."""
        mine = asdict(plan)
        plans: list[Any] = [None] * self.world_size
        dist.all_gather_object(plans, mine, group=self.group)
        differing = [r for r, other in enumerate(plans) if other != plans[0]]
        if differing:
            raise ConfigError(
                "distributed plan",
                f"rank(s) {differing} differ from rank 0",
                "the ranks would sample, clip or noise differently, so the accounted step would not be "
                f"the one taken (rank 0: {plans[0]}, rank {differing[0]}: {plans[differing[0]]})",
                "give every rank the same dataset, batch size, σ or targets, clip norm and accountant",
            )

    # -- what make_private builds -----------------------------------------------------------------
    def broadcast_parameters(self) -> None:
        """Copy rank 0's parameters and buffers to every rank (in place), so replicas start identical."""
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.data, src=source, group=self.group)

    def sampler(
        self, dataset_size: int, sampling_rate: float, steps_per_epoch: int, rng: RandomSource
    ) -> ShardedPoissonBatchSampler:
        return ShardedPoissonBatchSampler(
            dataset_size, sampling_rate, steps_per_epoch, rng, rank=self.rank, world_size=self.world_size
        )

    @property
    def optimizer_class(self) -> Any:
        """``DistributedDPOptimizer`` bound to this rank and group (same keywords as ``DPOptimizer``)."""
        return functools.partial(
            DistributedDPOptimizer, rank=self.rank, world_size=self.world_size, group=self.group
        )

    def guard_wrapper(self) -> None:
        """Make a gradient-recording forward through the DDP wrapper raise (see module docstring)."""
        if self.wrapper is None or self._guard is not None:
            return

        def refuse(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and module.training:
                raise ConfigError(
                    "model",
                    "the DistributedDataParallel wrapper",
                    "its backward would all-reduce unclipped gradients, which DP-SGD must never form; "
                    "veil all-reduces the clipped sums itself",
                    "call the model returned by make_private (the inner module) instead",
                )

        self._guard = self.wrapper.register_forward_pre_hook(refuse)


def resolve_setup(module: nn.Module, distributed: bool | None) -> DistributedSetup | None:
    """None for a one-process run; else the checked :class:`DistributedSetup` (see module docstring).

    ``distributed=None`` means "if ``module`` is DDP-wrapped". ``distributed=False`` with a DDP module
    is refused (DDP would average unclipped gradients).
    """
    wrapper = module if isinstance(module, DistributedDataParallel) else None
    if distributed is None:
        distributed = wrapper is not None
    if distributed not in (True, False):
        raise ConfigError("distributed", distributed, "the mode must be explicit", "pass True, False or None")
    if not distributed:
        if wrapper is not None:
            raise ConfigError(
                "distributed",
                False,
                "a DistributedDataParallel module all-reduces unclipped gradients in backward",
                "pass distributed=True (or leave it out), or pass the unwrapped module",
            )
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "distributed",
            True,
            "training across ranks needs a process group to all-reduce the clipped sums",
            "call torch.distributed.init_process_group(...) first (torchrun sets the environment), "
            "or train in one process with distributed=False",
        )
    group = wrapper.process_group if wrapper is not None else None
    return DistributedSetup(
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        group=group,
        module=wrapper.module if wrapper is not None else module,
        wrapper=wrapper,
    )
