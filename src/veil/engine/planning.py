"""Planning: the privacy settings of a run read from ``make_private``'s arguments, checked, and fixed.

Every function here only checks and computes; nothing is built or changed. The result is the frozen
:class:`~veil.plan.PrivacyPlan` (σ, C, q, B, N, steps per epoch, sampling, clipping, loss reduction,
accountant, privacy unit). σ is either given or calibrated on the private side of a target
(:func:`noise_multiplier`): for Poisson sampling each step is ``PoissonSampled(q, Gaussian(σ))``; for
the opt-in shuffled loader each step is ``Gaussian(σ/2)`` (see :mod:`veil.engine`), so σ is calibrated
at q = 1 and doubled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from veil.accounting.base import AccountantName, PrivacyAccountant
from veil.errors import DataError, InvalidParameterError, SamplingError
from veil.plan import PrivacyPlan, Sampling
from veil.sampling import check_sampling_rate, steps_per_epoch

if TYPE_CHECKING:
    from veil.units import UnitPlan

__all__ = [
    "Sizes",
    "check_accountant",
    "check_clip",
    "check_data_loader",
    "check_sampling",
    "finite_positive",
    "make_plan",
    "noise_multiplier",
    "resolve_loss_reduction",
    "sizes",
]


def finite_positive(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def check_clip(max_grad_norm: Any, clipping: Any) -> None:
    """The clip norm C (finite, > 0) and the clipping mode."""
    if not finite_positive(max_grad_norm):
        raise InvalidParameterError(
            "max_grad_norm",
            max_grad_norm,
            "the clip norm C bounds each example's influence; it must be a finite number > 0",
            "pass max_grad_norm > 0, e.g. 1.0",
        )
    if clipping not in ("flat", "per_layer"):
        raise InvalidParameterError(
            "clipping", clipping, "unknown clipping mode", "use 'flat' or 'per_layer'"
        )


def resolve_loss_reduction(loss_reduction: str | None, criterion: nn.Module | None) -> Literal["mean", "sum"]:
    """The loss reduction: the one passed, else the criterion's, else ``"mean"``; a mismatch is refused."""
    detected = getattr(criterion, "reduction", None) if criterion is not None else None
    for name, value in (("criterion.reduction", detected), ("loss_reduction", loss_reduction)):
        if value is not None and value not in ("mean", "sum"):
            raise InvalidParameterError(
                name,
                value,
                "each example's gradient is recovered from a loss reduced to one scalar by 'mean' or 'sum'; "
                "an unreduced loss has no such gradient to clip",
                "use reduction='mean' (or 'sum') in the loss and pass loss_reduction to match",
            )
    if detected is not None and loss_reduction is not None and detected != loss_reduction:
        raise InvalidParameterError(
            "loss_reduction",
            loss_reduction,
            f"the criterion reduces with {detected!r}; a mismatch scales every per-example gradient wrongly "
            "before clipping",
            f"pass loss_reduction={detected!r} or leave it out",
        )
    chosen = loss_reduction or detected or "mean"
    return "sum" if chosen == "sum" else "mean"


def check_sampling(poisson_sampling: bool, allow_non_poisson: bool) -> Sampling:
    """Poisson (the default), or the shuffled loader only when its unamplified accounting is accepted."""
    if poisson_sampling:
        return "poisson"
    if not allow_non_poisson:
        raise SamplingError(
            "poisson_sampling",
            False,
            "fixed-size shuffled batches get no privacy amplification by sampling, so the same noise "
            "buys a much larger ε; accounting them as Poisson (as Opacus does when it keeps your "
            "shuffled loader under poisson_sampling=False) would under-state ε",
            "keep poisson_sampling=True (recommended), or also pass allow_non_poisson=True to accept "
            "ε accounted without amplification",
        )
    return "shuffled_not_amplified"


def check_data_loader(data_loader: Any) -> tuple[Dataset[Any], int, int]:
    """``(dataset, N, B)``: a map-style dataset (N may be 0: :func:`sizes` decides) and the loader's
    expected batch size."""
    if not isinstance(data_loader, DataLoader):
        raise SamplingError(
            "data_loader",
            type(data_loader).__name__,
            "the sampling rate is read from a DataLoader",
            "pass a torch DataLoader",
        )
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise SamplingError(
            "data_loader.dataset",
            type(dataset).__name__,
            "Poisson sampling needs random access to a dataset of known size",
            "use a map-style Dataset (with __len__ and __getitem__)",
        )
    n = len(dataset)
    batch_size = data_loader.batch_size
    if batch_size is None:
        raise SamplingError(
            "data_loader.batch_size",
            None,
            "the expected batch size q·N is read from the loader's batch_size; a batch sampler hides it",
            "build the DataLoader with batch_size=<expected logical batch size>",
        )
    return dataset, n, batch_size


class Sizes(NamedTuple):
    """What Poisson sampling draws from: rows, or privacy units (``units`` set). ``population`` is the
    size the rate is computed against (q = B / population, ⌈population/B⌉ steps per epoch);
    ``drawn`` the records the sampler visits (the same, unless a public population was given)."""

    units: UnitPlan | None
    population: int
    batch_size: int
    sampling_rate: float
    steps_per_epoch: int
    drawn: int


def sizes(
    n: int,
    batch_size: int,
    sampling: Sampling,
    unit_ids: Sequence[Any] | None,
    max_rows_per_unit: int | None,
    distributed: bool,
    population: int | None = None,
) -> Sizes:
    """q = B / (rows or units) and ⌈N/B⌉ steps per epoch, after the privacy-unit request is checked.

    ``population``: a public size to compute q and the steps against instead of the dataset's own
    count (``veil tune``'s ⌊(1 − F)·N⌋ for a training part whose exact size is private). Each record
    is still drawn independently at that q, which was fixed before any row was seen: Poisson
    sampling at a data-independent rate, whose amplification holds whatever the part's real size.
    Poisson sampling in one process only.

    An empty dataset is refused unless ``population`` is given: without one, its size is the size the
    caller planned on (public, so the refusal says nothing about a record). With one, the dataset's
    own size is private and may be 0 (``veil tune``'s keyed split can leave the training part empty):
    no refusal depends on it; every planned step is taken, each an update of pure noise, and charged.
    """
    from veil.units import check_units

    units = check_units(unit_ids, max_rows_per_unit, n, batch_size, sampling, distributed)
    drawn = n if units is None else len(units.rows)
    if population is None and drawn < 1:
        raise DataError("dataset", "empty", "there is nothing to train on", "pass a non-empty dataset")
    if population is None:
        population = drawn
    elif sampling != "poisson" or distributed:
        raise SamplingError(
            "population",
            population,
            "a public population fixes the rate of Poisson sampling in one process",
            "drop population, or sample by Poisson in one process",
        )
    q = check_sampling_rate(batch_size, population)
    return Sizes(units, population, batch_size, q, steps_per_epoch(population, batch_size), drawn)


def noise_multiplier(
    noise_multiplier: float | None,
    targets: tuple[float | None, float | None, float | None],
    sizes: Sizes,
    sampling: Sampling,
    accountant: AccountantName,
) -> float:
    """σ as given, or calibrated for ``epochs × steps_per_epoch`` steps from ``(ε, δ, epochs)``."""
    if noise_multiplier is not None:
        if any(t is not None for t in targets):
            raise InvalidParameterError(
                "noise_multiplier",
                noise_multiplier,
                "σ is either given or calibrated from (target_epsilon, target_delta, epochs), not both",
                "pass noise_multiplier alone, or the three targets alone",
            )
        if (
            isinstance(noise_multiplier, bool)
            or not isinstance(noise_multiplier, (int, float))
            or not (math.isfinite(noise_multiplier) and noise_multiplier >= 0)
        ):
            raise InvalidParameterError(
                "noise_multiplier",
                noise_multiplier,
                "σ scales the noise and must be finite and ≥ 0",
                "pass σ ≥ 0",
            )
        return float(noise_multiplier)
    target_epsilon, target_delta, epochs = targets
    if target_epsilon is None or target_delta is None or epochs is None:
        raise InvalidParameterError(
            "noise_multiplier",
            None,
            "without σ the noise must be calibrated, which needs target_epsilon, target_delta and epochs",
            "pass noise_multiplier, or all of target_epsilon, target_delta and epochs",
        )
    if not finite_positive(epochs):
        raise InvalidParameterError(
            "epochs", epochs, "calibration needs the planned length of training", "pass epochs > 0"
        )
    n = sizes.population
    if not finite_positive(target_delta) or target_delta >= 1.0 / n:
        raise InvalidParameterError(
            "target_delta",
            target_delta,
            f"δ ≥ 1/N (N = {n}) allows a mechanism that publishes one whole record outright",
            f"pass δ well below 1/N, e.g. {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
        )
    from veil.accounting.calibrate import calibrate_noise

    steps = math.ceil(epochs * sizes.steps_per_epoch)
    if sampling == "poisson":
        return float(
            calibrate_noise(target_epsilon, target_delta, sizes.sampling_rate, steps, accountant=accountant)
        )
    # Shuffled: each step is Gaussian(σ/2) (see veil.engine's docstring); q = 1 means "no sampling".
    return 2.0 * float(calibrate_noise(target_epsilon, target_delta, 1.0, steps, accountant=accountant))


def make_plan(
    sigma: float,
    max_grad_norm: float,
    sizes: Sizes,
    sampling: Sampling,
    clipping: Literal["flat", "per_layer"],
    loss_reduction: Literal["mean", "sum"],
    accountant: AccountantName,
) -> PrivacyPlan:
    """The frozen plan of the run (nothing about performance)."""
    units = sizes.units
    return PrivacyPlan(
        noise_multiplier=sigma,
        max_grad_norm=float(max_grad_norm),
        sampling_rate=sizes.sampling_rate,
        expected_batch_size=sizes.batch_size,
        dataset_size=sizes.population,
        steps_per_epoch=sizes.steps_per_epoch,
        sampling=sampling,
        clipping=clipping,
        loss_reduction=loss_reduction,
        accountant=accountant,
        privacy_unit="row" if units is None else "unit",
        max_rows_per_unit=None if units is None else units.max_rows,
    )


def check_accountant(accountant: PrivacyAccountant, name: AccountantName, plan: PrivacyPlan) -> None:
    """Refuse a plan whose per-step event the engine's accountant cannot compose."""
    if not accountant.supports(plan.event):
        raise InvalidParameterError(
            "accountant",
            name,
            f"it cannot account for this run's steps ({plan.event.to_json()})",
            "use accountant='pld'",
        )
