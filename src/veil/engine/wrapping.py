"""Wrapping: the user's model, optimizer and data loader checked, then turned into their private forms.

Checks (nothing changes): the optimizer is a plain ``torch.optim`` optimizer over exactly the model's
trainable parameters, the model passes the validator and the example-mixing probe, the physical
batch size is an int ≥ 1. Builds (after every check passed, in :meth:`PrivacyEngine.make_private`):
the :class:`~veil.clipping.PerSampleClipper` on the module, the logical batch sampler (Poisson over
rows or units, a rank's shard, or the opt-in shuffled one), the :class:`~veil.sampling.PrivateDataLoader`
with the user's loader's performance settings, and the :class:`~veil.optimizer.DPOptimizer` (or a
rank's all-reducing one) wrapping the user's optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from veil.errors import InvalidParameterError, ModelNotSupportedError, Problem
from veil.mixing_probe import probe_forward, public_loaders
from veil.optimizer import DPOptimizer
from veil.per_example_loss import LoopLossGuard
from veil.plan import PrivacyPlan
from veil.sampling import PoissonBatchSampler, PrivateDataLoader, ShuffledBatchSampler, StepSignal
from veil.validation import validate

if TYPE_CHECKING:
    from veil.clipping import PerSampleClipper
    from veil.engine.planning import Sizes
    from veil.engine.ranks import RankContext
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "PrivateTraining",
    "PrivateTrainingWithCriterion",
    "check_model",
    "check_module_type",
    "check_optimizer",
    "check_optimizer_type",
    "check_physical_batch_size",
    "loader_kwargs",
    "private_loader",
    "private_optimizer",
    "template_item",
]


class PrivateTraining(NamedTuple):
    """What ``make_private`` returns; unpacks as ``model, optimizer, loader``."""

    model: nn.Module
    optimizer: DPOptimizer
    data_loader: PrivateDataLoader


class PrivateTrainingWithCriterion(NamedTuple):
    """``make_private(grad_sample_mode="ghost")``'s return, the shape Opacus code unpacks there.

    ``criterion`` is the loss itself: veil clips in the ordinary backward pass, so no wrapper is needed.
    """

    model: nn.Module
    optimizer: DPOptimizer
    criterion: nn.Module
    data_loader: PrivateDataLoader


def check_module_type(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise InvalidParameterError(
            "module", type(module).__name__, "only an nn.Module can be clipped", "pass an nn.Module"
        )


def check_optimizer_type(optimizer: Any) -> None:
    if not isinstance(optimizer, Optimizer) or isinstance(optimizer, DPOptimizer):
        raise InvalidParameterError(
            "optimizer",
            type(optimizer).__name__,
            "the engine wraps a plain torch.optim optimizer once",
            "pass the torch.optim optimizer built on the model's parameters",
        )


def check_physical_batch_size(physical_batch_size: Any) -> None:
    if physical_batch_size is not None and (
        isinstance(physical_batch_size, bool)
        or not isinstance(physical_batch_size, int)
        or physical_batch_size < 1
    ):
        raise InvalidParameterError(
            "physical_batch_size",
            physical_batch_size,
            "a chunk must hold at least one example",
            "pass an int ≥ 1 or None",
        )


def check_optimizer(module: nn.Module, optimizer: Optimizer) -> None:
    """The optimizer updates exactly the model's trainable parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = sorted(names[i] for i in trainable - in_optimizer)
    if missing:
        raise InvalidParameterError(
            "optimizer",
            f"missing {len(missing)} trainable parameter(s): {', '.join(missing[:5])}",
            "every trainable parameter is clipped and noised; one the optimizer does not update "
            "signals a mismatch between the model and the optimizer",
            "build the optimizer from model.parameters() (or freeze those with requires_grad=False)",
        )
    extra = in_optimizer - set(names)
    if extra:
        raise InvalidParameterError(
            "optimizer",
            f"{len(extra)} parameter(s) not in the model",
            "their gradients bypass per-sample clipping and noise, so their updates are not private",
            "pass only the model's own parameters to the optimizer",
        )


def check_model(module: nn.Module, data_loader: DataLoader, template: Any = None) -> str:
    """The validator's problems and the example-mixing probe on synthetic items shaped like the
    loader's (:func:`~veil.mixing_probe.public_loaders`: every public draw probed, refused if any
    mixes); returns the probe's verdict ("passed" if any draw passed, else the first reason skipped).

    ``template`` (with a public population: :func:`template_item`, from the dataset's structure):
    the probe's items are shaped from it and the dataset's private size is never consulted, so a
    mixing model is refused alike at 0, 1 or many rows."""
    problems = validate(module)
    if problems:
        raise ModelNotSupportedError(problems)
    loaders = public_loaders(data_loader, module, template)  # the items' structure, never their values
    if isinstance(loaders, str):
        return loaders
    verdicts = []
    for loader in loaders:
        probe = probe_forward(module, loader)
        if isinstance(probe, Problem):
            raise ModelNotSupportedError([probe])
        verdicts.append(probe)
    return "passed" if "passed" in verdicts else verdicts[0]


def template_item(dataset: Any, population: int | None) -> Any:
    """The item an empty Poisson batch is shaped from (:class:`~veil.sampling.EmptyBatchCollate`).

    Without a public ``population`` the dataset's size is the planned one and at least 1
    (:func:`veil.engine.planning.sizes`): its first item. With one, the dataset's size is private and
    may be 0, so the template is read from the dataset's structure, never from a row: a
    ``TensorDataset``'s per-row shapes and dtypes (zeros), or the dataset's own ``template_item()``.
    Any other dataset is refused here, whatever its size (a rule on its type, checked before a row is
    drawn), so that a zero-row part takes its planned steps like any other."""
    if population is None:
        return dataset[0]
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset):
        return tuple(t.new_zeros(t.shape[1:]) for t in dataset.tensors)
    if callable(getattr(dataset, "template_item", None)):
        return dataset.template_item()
    raise InvalidParameterError(
        "population",
        f"a {type(dataset).__name__}",
        "with a public population the dataset's own size may be 0, and the shape of an empty batch "
        "must then come from the dataset's structure, not from a row",
        "pass a TensorDataset, or give the dataset a template_item() method returning a zero item",
    )


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The performance settings of the user's loader, carried over to the private one."""
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def _logical_sampler(
    plan: PrivacyPlan, sizes: Sizes, ranks: RankContext | None, rng: RandomSource
) -> PoissonBatchSampler | ShuffledBatchSampler:
    q, per_epoch = plan.sampling_rate, plan.steps_per_epoch
    if ranks is not None:
        return ranks.sampler(plan.dataset_size, q, per_epoch, rng)
    if sizes.units is not None:
        from veil.units import UnitPoissonSampler

        return UnitPoissonSampler(sizes.units.rows, q, per_epoch, rng, sizes.units.max_rows)
    if plan.sampling == "poisson":
        return PoissonBatchSampler(sizes.drawn, q, per_epoch, rng)
    return ShuffledBatchSampler(plan.dataset_size, plan.expected_batch_size, per_epoch, rng)


def private_loader(
    data_loader: DataLoader,
    collate: Any,
    plan: PrivacyPlan,
    sizes: Sizes,
    ranks: RankContext | None,
    rng: RandomSource,
    physical_batch_size: int | None,
    template: Any,
) -> tuple[PrivateDataLoader, StepSignal]:
    """Logical batches drawn by the plan's sampler over the user's dataset, and the step signal
    (``template``: the item empty batches are shaped from, :func:`template_item`)."""
    signal = StepSignal()
    dataset = data_loader.dataset
    loader = PrivateDataLoader(
        dataset,
        _logical_sampler(plan, sizes, ranks, rng),
        expected_batch_size=plan.expected_batch_size,
        physical_batch_size=physical_batch_size,
        signal=signal,
        collate_fn=collate,
        template_item=template,
        **loader_kwargs(data_loader),
    )
    return loader, signal


def private_optimizer(
    optimizer: Optimizer,
    clipper: PerSampleClipper,
    plan: PrivacyPlan,
    ranks: RankContext | None,
    noise_source: RandomSource,
    signal: StepSignal,
    on_release: Callable[[], None],
) -> DPOptimizer:
    """The user's optimizer behind per-sample clipping and one noise draw per logical step."""
    dp_optimizer = (DPOptimizer if ranks is None else ranks.optimizer_class)(
        optimizer,
        clipper=clipper,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.max_grad_norm,
        expected_batch_size=plan.expected_batch_size,
        noise_source=noise_source,
        signal=signal,
        on_release=on_release,
    )
    dp_optimizer.loss_guard = LoopLossGuard(clipper.module, plan.loss_reduction, rows=clipper.rows_in_flight)
    return dp_optimizer
