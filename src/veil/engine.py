"""``PrivacyEngine.make_private``: the Opacus-familiar facade over veil's DP-SGD.

    engine = veil.PrivacyEngine()  # noise and sampling from the OS CSPRNG (reproducible=True: seeded)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad(); criterion(model(x), y).backward(); optimizer.step()
    engine.get_epsilon(1e-5)

Behind the facade is a frozen :class:`PrivacyPlan` (σ, C, q, B, sampling, clipping, loss reduction):
the privacy settings. Performance settings (``physical_batch_size``, dtype, device, workers) are
not part of the plan and cannot change it.

Accounting (add/remove-one neighbouring, the accountant's relation). Each logical step composes one
event into ``engine.accountant`` before its update is written:

* Poisson sampling (default): ``PoissonSampled(q, Gaussian(σ))`` with q = batch_size / len(dataset)
  (``Gaussian(σ)`` when q = 1).
* Privacy units (``unit_ids=``, one unit id per dataset row; :mod:`veil.units`): the same
  ``PoissonSampled(q, Gaussian(σ))`` with q = batch_size / (number of units), for the
  add/remove-one-*unit* relation: units are Poisson-sampled, each contributes at most
  ``max_rows_per_unit`` rows, and the mean of its rows' gradients is clipped once.
* The opt-in fixed-size shuffled loader (``poisson_sampling=False, allow_non_poisson=True``):
  ``Gaussian(σ/2)`` per step, no amplification by sampling. Why σ/2: with fixed-size batches, adding
  one record to the dataset displaces another, so (under the coupling that puts the displaced record
  in the added record's place) one step's sum changes by a *replacement*, up to 2C, and one other step
  by up to C. Accounting every step at sensitivity 2C bounds that for every prefix of a run.
* ``noise_multiplier=0`` (tests, baselines): ``NonPrivate`` per step, so ε = ∞ is reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import numpy as np
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from veil.accounting.base import AccountantName, PrivacyAccountant, make_accountant
from veil.accounting.events import PrivacyEvent, event_from_dict
from veil.compat import opacus_args
from veil.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    InvalidParameterError,
    ModelNotSupportedError,
    Problem,
    SamplingError,
)
from veil.mixing_probe import probe_forward, refuse_example_mixing
from veil.optimizer import DPOptimizer
from veil.per_example_loss import LoopLossGuard, RefuseIgnoredTargets, check_criterion
from veil.plan import PrivacyPlan, Sampling
from veil.sampling import (
    PoissonBatchSampler,
    PrivateDataLoader,
    ShuffledBatchSampler,
    StepSignal,
    check_sampling_rate,
    steps_per_epoch,
)
from veil.validation import validate

if TYPE_CHECKING:
    from veil.clipping import PerSampleClipper
    from veil.distributed import DistributedSetup
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "PrivacyEngine",
    "PrivacyPlan",
    "PrivateTraining",
    "PrivateTrainingWithCriterion",
    "refuse_example_mixing",
]

_STATE_FORMAT = "veil.engine/1"


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


def _finite_positive(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def _resolve_loss_reduction(
    loss_reduction: str | None, criterion: nn.Module | None
) -> Literal["mean", "sum"]:
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


def _check_optimizer(module: nn.Module, optimizer: Optimizer) -> None:
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


def _child_seeds(seed: int | None) -> tuple[int | None, int | None]:
    if seed is None:
        return None, None
    noise, sampler = np.random.SeedSequence(seed).spawn(2)
    return int(noise.generate_state(1)[0]), int(sampler.generate_state(1)[0])


Randomness = Literal["secure", "seeded"]


def _resolve_randomness(secure_rng: Any, seed: Any, reproducible: Any) -> Randomness:
    """``"secure"`` unless research mode is asked for (``reproducible=True`` or ``secure_rng=False``).

    Checked before anything is built: a conflicting pair, or a seed for a secure engine, is refused
    (a seed that silently stopped seeding the noise would mislead a researcher; a seed that silently
    seeded it would make a "private" run replayable by whoever reads the seed).
    """
    if not isinstance(reproducible, bool):
        raise InvalidParameterError(
            "reproducible", reproducible, "the randomness mode must be explicit", "pass True or False"
        )
    if secure_rng is not None and not isinstance(secure_rng, bool):
        raise InvalidParameterError(
            "secure_rng", secure_rng, "the randomness mode must be explicit", "pass True, False or None"
        )
    if secure_rng is True and reproducible:
        raise InvalidParameterError(
            "secure_rng",
            secure_rng,
            "reproducible=True asks for seeded noise, which secure_rng=True forbids",
            "pass one of them: reproducible=True (research) or neither (secure, the default)",
        )
    seeded = reproducible or secure_rng is False
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidParameterError("seed", seed, "a seed must be a non-negative integer", "pass e.g. seed=0")
    if seed is not None and not seeded:
        raise InvalidParameterError(
            "seed",
            seed,
            "noise and Poisson sampling come from the OS CSPRNG by default; a seeded generator is "
            "predictable, so noise from it protects nothing against anyone who knows the seed",
            "drop the seed for a private run, or pass reproducible=True together with the seed for a "
            "seeded research run (not private against anyone who knows the seed)",
        )
    return "seeded" if seeded else "secure"


class PrivacyEngine:
    """DP-SGD for any ``nn.Module``: per-sample clipping, Gaussian noise, Poisson sampling, accounting.

    ``accountant``: ``"pld"`` (default, tight) or ``"rdp"``.

    Randomness (secure by default). Unless research mode is asked for, the Gaussian noise *and* the
    Poisson sampling are drawn from the operating system's CSPRNG through
    :class:`~veil.mechanisms.rng.SecureSource` (``engine.randomness == "secure"``): no seed, no
    generator state in :meth:`state_dict`, never torch's or numpy's global generators; a resumed run
    draws fresh noise. Guarantee: the released updates are (ε, δ)-DP for the add/remove-one relation
    against an adversary who sees everything the run writes (model, checkpoints, engine state).

    Research mode, ``reproducible=True`` (or the legacy ``secure_rng=False``): noise and sampling come
    from seeded generators (``seed``, or fresh entropy when None), reproducible and resumable exactly.
    It is **not** private against anyone who knows the seed; ``engine.release_ready`` is then False.
    A ``seed`` without research mode is refused with :class:`~veil.errors.InvalidParameterError`.
    ``secure_rng=True`` is accepted (it is the default) and conflicts with ``reproducible=True``.

    One engine trains one model: call ``make_private`` once. Opacus's ``accountant="prv"``/``"rdp"`` and
    ``secure_mode=`` are accepted (``gdp`` is refused); see ``docs/migrating-from-opacus.md``.
    """

    def __init__(
        self,
        accountant: AccountantName = "pld",
        secure_rng: bool | None = None,
        seed: int | None = None,
        *,
        reproducible: bool = False,
        secure_mode: bool | None = None,
    ) -> None:
        # Opacus's names (accountant="prv"/"gdp", secure_mode=...): see veil.compat.opacus_args.
        accountant = opacus_args.resolve_accountant(accountant)
        secure_rng = opacus_args.resolve_secure_mode(secure_mode, secure_rng, seed)
        randomness = _resolve_randomness(secure_rng, seed, reproducible)
        from veil.mechanisms.rng import make_source

        self.accountant: PrivacyAccountant = make_accountant(accountant)
        self.accountant_name: AccountantName = accountant
        self._randomness: Randomness = randomness
        self.secure_rng = randomness == "secure"
        noise_seed, sampler_seed = _child_seeds(seed)
        self.noise_source: RandomSource = make_source(self.secure_rng, noise_seed)
        self.sampler_source: RandomSource = make_source(self.secure_rng, sampler_seed)
        self.plan: PrivacyPlan | None = None
        self.forward_probe: str | None = None
        self._steps = 0
        self._optimizer: DPOptimizer | None = None
        self._loader: PrivateDataLoader | None = None
        self._clipper: PerSampleClipper | None = None
        self.distributed: DistributedSetup | None = None

    @property
    def randomness(self) -> Randomness:
        """``"secure"`` (OS CSPRNG, the default) or ``"seeded"`` (research mode, replayable)."""
        return self._randomness

    @property
    def release_ready(self) -> bool:
        """True when what this engine trains may be released under its stated guarantee.

        That needs secure randomness (seeded noise can be recomputed by whoever knows the seed) and,
        once ``make_private`` ran, noise at all (σ > 0; σ = 0 is accounted as ε = ∞).
        """
        if self._randomness != "secure":
            return False
        return self.plan is None or self.plan.noise_multiplier > 0

    # -- the facade ----------------------------------------------------------------------------
    @overload
    def make_private(
        self, *, grad_sample_mode: Literal["ghost"], **kwargs: Any
    ) -> PrivateTrainingWithCriterion: ...

    @overload
    def make_private(
        self, *, grad_sample_mode: Literal["hooks", "functorch", "ew"] | None = None, **kwargs: Any
    ) -> PrivateTraining: ...

    def make_private(  # type: ignore[misc]  # the overloads only name the two return shapes
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: float | None = None,
        clipping: Literal["flat", "per_layer"] = "flat",
        loss_reduction: Literal["mean", "sum"] | None = None,
        criterion: nn.Module | None = None,
        physical_batch_size: int | None = None,
        poisson_sampling: bool = True,
        allow_non_poisson: bool = False,
        batch_first: bool = True,
        grad_sample_mode: str | None = None,
        noise_generator: Any = None,
        wrap_model: bool = True,
        rand_on_empty: bool = False,
        distributed: bool | None = None,
        unit_ids: Sequence[Any] | None = None,
        max_rows_per_unit: int | None = None,
    ) -> PrivateTraining | PrivateTrainingWithCriterion:
        """Make ``module``/``optimizer``/``data_loader`` private; returns ``(model, optimizer, loader)``.

        Give either ``noise_multiplier`` or ``target_epsilon`` + ``target_delta`` + ``epochs`` (σ is then
        calibrated, on the private side of the target, for ``epochs × ⌈N/B⌉`` steps). ``loss_reduction``
        defaults to the criterion's ``reduction`` when a criterion is passed, else ``"mean"``. The loss
        must be a fixed-coefficient sum of per-example terms (see :mod:`veil.per_example_loss`): a
        ``criterion`` with ``weight=`` and ``reduction="mean"`` is refused, and with ``"mean"`` a batch
        whose targets contain the criterion's ``ignore_index`` is refused as it is collated. Everything
        is checked before anything changes; a refusal leaves the model, optimizer and engine untouched.
        The returned model is ``module`` itself (with the clipper's hooks); the optimizer wraps
        ``optimizer``; the loader replaces ``data_loader`` with Poisson-sampled logical batches of expected
        size ``data_loader.batch_size`` over the same dataset, collate function and workers.

        Opacus's arguments (``batch_first``, ``grad_sample_mode``, ``noise_generator``, ``wrap_model``,
        ``rand_on_empty``) are checked by :mod:`veil.compat.opacus_args`; ``grad_sample_mode="ghost"``
        returns ``(model, optimizer, criterion, loader)`` as Opacus does.

        Across ranks (a ``DistributedDataParallel`` module, or ``distributed=True`` under an initialised
        process group; see :mod:`veil.distributed`): ``data_loader.batch_size`` is the *global* expected
        batch size, each rank's loader yields its shard of every logical batch, the returned model is
        the inner (unwrapped) module, and the clipped sums are all-reduced once per logical step.

        Privacy units (``unit_ids``: one hashable id per row of ``data_loader.dataset``, in dataset
        order; see :mod:`veil.units`): the guarantee protects every row sharing an id at once.
        ``data_loader.batch_size`` is then the expected number of *units* per step, q = batch_size /
        (number of distinct ids), each sampled unit contributes at most ``max_rows_per_unit`` rows (K;
        default :func:`veil.units.default_max_rows_per_unit`), the mean of its rows' gradients is
        clipped once to C, and δ is checked against 1/(number of units). ``physical_batch_size``
        counts rows, and a chunk never splits a unit. Poisson sampling in one process only.
        """
        if self.plan is not None:
            raise ConfigError(
                "make_private",
                "called twice",
                "one engine accounts for one training run; a second model on the same accountant would "
                "entangle two runs' checkpoints",
                "create one PrivacyEngine per model",
            )
        opacus_args.check_make_private_args(
            batch_first=batch_first,
            grad_sample_mode=grad_sample_mode,
            clipping=clipping,
            max_grad_norm=max_grad_norm,
            wrap_model=wrap_model,
            rand_on_empty=rand_on_empty,
        )
        noise_seed = opacus_args.check_noise_generator(noise_generator, not self.noise_source.secure)
        if not isinstance(module, nn.Module):
            raise InvalidParameterError(
                "module", type(module).__name__, "only an nn.Module can be clipped", "pass an nn.Module"
            )
        from veil.distributed.setup import resolve_setup

        ranks = resolve_setup(module, distributed)  # None in one process
        if ranks is not None:
            module = ranks.module  # DDP's own averaging must never see unclipped gradients
        if not isinstance(optimizer, Optimizer) or isinstance(optimizer, DPOptimizer):
            raise InvalidParameterError(
                "optimizer",
                type(optimizer).__name__,
                "the engine wraps a plain torch.optim optimizer once",
                "pass the torch.optim optimizer built on the model's parameters",
            )
        if not _finite_positive(max_grad_norm):
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
        reduction = _resolve_loss_reduction(loss_reduction, criterion)
        ignore_index = check_criterion(criterion, reduction)
        sampling = self._check_sampling(poisson_sampling, allow_non_poisson)
        if ranks is not None:
            ranks.check_sampling(sampling)
            ranks.check_loader(data_loader)
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
        if n < 1:
            raise DataError("dataset", "empty", "there is nothing to train on", "pass a non-empty dataset")
        batch_size = data_loader.batch_size
        if batch_size is None:
            raise SamplingError(
                "data_loader.batch_size",
                None,
                "the expected batch size q·N is read from the loader's batch_size; a batch sampler hides it",
                "build the DataLoader with batch_size=<expected logical batch size>",
            )
        from veil.units import check_units

        units = check_units(unit_ids, max_rows_per_unit, n, batch_size, sampling, ranks is not None)
        n_sampled = n if units is None else len(units.rows)  # what Poisson sampling draws: rows or units
        q = check_sampling_rate(batch_size, n_sampled)
        per_epoch = steps_per_epoch(n_sampled, batch_size)
        _check_optimizer(module, optimizer)
        problems = validate(module)
        if problems:
            raise ModelNotSupportedError(problems)
        probe = probe_forward(module, data_loader)
        if isinstance(probe, Problem):
            raise ModelNotSupportedError([probe])
        collate = data_loader.collate_fn
        if ignore_index is not None:
            collate = RefuseIgnoredTargets(collate, ignore_index)
            collate([dataset[0]])  # the empty-batch template is collated below: refuse it here
        # Last among the checks: calibration can take seconds.
        sigma = self._noise_multiplier(
            noise_multiplier, target_epsilon, target_delta, epochs, q, per_epoch, n_sampled, sampling
        )
        plan = PrivacyPlan(
            noise_multiplier=sigma,
            max_grad_norm=float(max_grad_norm),
            sampling_rate=q,
            expected_batch_size=batch_size,
            dataset_size=n_sampled,
            steps_per_epoch=per_epoch,
            sampling=sampling,
            clipping=clipping,
            loss_reduction=reduction,
            accountant=self.accountant_name,
            privacy_unit="row" if units is None else "unit",
            max_rows_per_unit=None if units is None else units.max_rows,
        )
        if not self.accountant.supports(plan.event):
            raise InvalidParameterError(
                "accountant",
                self.accountant_name,
                f"it cannot account for this run's steps ({plan.event.to_json()})",
                "use accountant='pld'",
            )
        if ranks is not None:
            ranks.agree(plan)  # a collective: every rank refuses together

        # -- every check passed: build and commit ----------------------------------------------
        if ranks is not None:
            ranks.broadcast_parameters()
        from veil.clipping import PerSampleClipper

        clipper = PerSampleClipper(module, float(max_grad_norm), clipping=clipping, loss_reduction=reduction)
        signal = StepSignal()
        logical: PoissonBatchSampler | ShuffledBatchSampler
        if ranks is not None:
            logical = ranks.sampler(n, q, per_epoch, self.sampler_source)
        elif units is not None:
            from veil.units import UnitPoissonSampler

            logical = UnitPoissonSampler(units.rows, q, per_epoch, self.sampler_source, units.max_rows)
        elif sampling == "poisson":
            logical = PoissonBatchSampler(n, q, per_epoch, self.sampler_source)
        else:
            logical = ShuffledBatchSampler(n, batch_size, per_epoch, self.sampler_source)
        loader = PrivateDataLoader(
            dataset,
            logical,
            expected_batch_size=batch_size,
            physical_batch_size=physical_batch_size,
            signal=signal,
            collate_fn=collate,
            template_item=dataset[0],
            **_loader_kwargs(data_loader),
        )
        if noise_seed is not None:
            from veil.mechanisms.rng import make_source

            self.noise_source = make_source(False, noise_seed)
        dp_optimizer = (DPOptimizer if ranks is None else ranks.optimizer_class)(
            optimizer,
            clipper=clipper,
            noise_multiplier=sigma,
            max_grad_norm=float(max_grad_norm),
            expected_batch_size=batch_size,
            noise_source=self.noise_source,
            signal=signal,
            on_release=self._account_step,
        )
        dp_optimizer.loss_guard = LoopLossGuard(module, reduction)
        if ranks is not None:
            ranks.guard_wrapper()
        self.distributed = ranks
        self.plan = plan
        self.forward_probe = probe
        if units is not None:
            from veil.units import unit_setter

            loader.on_units = unit_setter(clipper)
        self._clipper, self._optimizer, self._loader = clipper, dp_optimizer, loader
        if opacus_args.returns_criterion(grad_sample_mode):
            return PrivateTrainingWithCriterion(
                module, dp_optimizer, criterion or nn.CrossEntropyLoss(reduction=reduction), loader
            )
        return PrivateTraining(module, dp_optimizer, loader)

    def _check_sampling(self, poisson_sampling: bool, allow_non_poisson: bool) -> Sampling:
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

    def _noise_multiplier(
        self,
        noise_multiplier: float | None,
        target_epsilon: float | None,
        target_delta: float | None,
        epochs: float | None,
        q: float,
        per_epoch: int,
        n: int,
        sampling: Sampling,
    ) -> float:
        targets = (target_epsilon, target_delta, epochs)
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
        if any(t is None for t in targets):
            raise InvalidParameterError(
                "noise_multiplier",
                None,
                "without σ the noise must be calibrated, which needs target_epsilon, target_delta and epochs",
                "pass noise_multiplier, or all of target_epsilon, target_delta and epochs",
            )
        assert target_epsilon is not None and target_delta is not None and epochs is not None
        if not _finite_positive(epochs):
            raise InvalidParameterError(
                "epochs", epochs, "calibration needs the planned length of training", "pass epochs > 0"
            )
        if not _finite_positive(target_delta) or target_delta >= 1.0 / n:
            raise InvalidParameterError(
                "target_delta",
                target_delta,
                f"δ ≥ 1/N (N = {n}) allows a mechanism that publishes one whole record outright",
                f"pass δ well below 1/N, e.g. {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
            )
        from veil.accounting.calibrate import calibrate_noise

        steps = math.ceil(epochs * per_epoch)
        if sampling == "poisson":
            return float(
                calibrate_noise(target_epsilon, target_delta, q, steps, accountant=self.accountant_name)
            )
        # Shuffled: each step is Gaussian(σ/2) (see the module docstring); q = 1 means "no sampling".
        return 2.0 * float(
            calibrate_noise(target_epsilon, target_delta, 1.0, steps, accountant=self.accountant_name)
        )

    def _account_step(self) -> None:
        assert self.plan is not None
        self.accountant.compose(self.plan.event)
        self._steps += 1

    # -- queries -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Logical steps (noisy updates) taken so far, each composed into the accountant."""
        return self._steps

    @property
    def sampling(self) -> Sampling | None:
        """``"poisson"`` or ``"shuffled_not_amplified"`` once ``make_private`` ran, else None."""
        return None if self.plan is None else self.plan.sampling

    @property
    def noise_multiplier(self) -> float | None:
        return None if self.plan is None else self.plan.noise_multiplier

    @property
    def max_grad_norm(self) -> float | None:
        return None if self.plan is None else self.plan.max_grad_norm

    @property
    def sampling_rate(self) -> float | None:
        return None if self.plan is None else self.plan.sampling_rate

    def get_epsilon(self, delta: float) -> float:
        """ε at ``delta`` for every step taken so far (∞ if any step was non-private, i.e. σ = 0).

        δ ≥ 1/N for this run's dataset is refused (an ε there promises nothing)."""
        if self.plan is not None:
            opacus_args.check_delta_for_dataset(delta, self.plan.dataset_size)
        return self.accountant.epsilon(delta)

    def make_private_with_epsilon(
        self, *, data_loader: DataLoader, target_delta: float, **kwargs: Any
    ) -> PrivateTraining | PrivateTrainingWithCriterion:
        """Opacus's name for ``make_private(target_epsilon=, target_delta=, epochs=, ...)`` (σ calibrated).

        δ ≥ 1/N is refused first, with the Opacus habit (a fixed δ = 1e-5 whatever N) named.
        """
        dataset = getattr(data_loader, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) > 0:
            opacus_args.check_delta_for_dataset(target_delta, len(dataset))
        return self.make_private(data_loader=data_loader, target_delta=target_delta, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, *, path: Any, module: nn.Module, **kwargs: Any) -> None:
        """Opacus's ``save_checkpoint``: model, optimizer and this engine's state in one ``torch.save`` file.

        See :func:`veil.compat.opacus_checkpoint.save_checkpoint` for the arguments."""
        from veil.compat.opacus_checkpoint import save_checkpoint

        save_checkpoint(self, path=path, module=module, **kwargs)

    def load_checkpoint(self, *, path: Any, module: nn.Module, **kwargs: Any) -> dict[str, Any]:
        """Opacus's ``load_checkpoint`` (after ``make_private`` with the same settings); returns the dict.

        See :func:`veil.compat.opacus_checkpoint.load_checkpoint` for the arguments."""
        from veil.compat.opacus_checkpoint import load_checkpoint

        return load_checkpoint(self, path=path, module=module, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume: plan, steps, accountant ledger (JSON events) and, in research mode only,
        the seeded generators' states (a resume then continues the exact stream).

        A secure engine's state holds no noise or sampler generator state (there is none to hold: the
        OS CSPRNG cannot be replayed), so a reader of the checkpoint learns nothing about the noise;
        a resume draws fresh noise and fresh batches.

        Save model and optimizer states alongside (``model.state_dict()``, ``optimizer.state_dict()``).
        Refused in the middle of a logical batch (after a physical chunk that did not close it).
        """
        if self.plan is None or self._optimizer is None or self._loader is None:
            raise CheckpointError(
                "engine", "not private yet", "there is no run to save", "call make_private first"
            )
        if self._optimizer.pending_chunks:
            raise CheckpointError(
                "engine",
                f"{self._optimizer.pending_chunks} chunk(s) pending",
                "a logical batch is half accumulated; its per-sample state is not saved",
                "save right after the optimizer step that closes a logical batch",
            )
        state: dict[str, Any] = {
            "format": _STATE_FORMAT,
            "plan": asdict(self.plan),
            "steps": self._steps,
            "ledger": _run_length(self.accountant.ledger.events),
            "randomness": self._randomness,
            "sampler": self._loader.state_dict(),
        }
        if self._randomness == "seeded":
            state["noise_rng"] = self.noise_source.state_dict()
        else:
            state["sampler"] = {**state["sampler"], "rng": None}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` after ``make_private`` with the same privacy settings.

        The accountant is rebuilt from the saved ledger; RNG states are restored when both the saved and
        this engine are seeded (a secure engine has no state to restore). Checked before anything
        changes: a mismatched plan raises :class:`~veil.errors.CheckpointError`.
        """
        if self.plan is None or self._loader is None:
            raise CheckpointError(
                "engine",
                "not private yet",
                "a state resumes a configured run",
                "call make_private, then load_state_dict",
            )
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise CheckpointError(
                "state.format",
                state.get("format") if isinstance(state, dict) else type(state).__name__,
                "not an engine state this version can read",
                "pass the dict returned by PrivacyEngine.state_dict()",
            )
        saved_plan = state.get("plan")
        if isinstance(saved_plan, dict):  # a state saved before privacy units: a row-level plan
            saved_plan = {"privacy_unit": "row", "max_rows_per_unit": None, **saved_plan}
        if saved_plan != asdict(self.plan):
            raise CheckpointError(
                "state.plan",
                saved_plan,
                f"the privacy settings differ from this engine's {asdict(self.plan)}, so the saved ledger "
                "would be continued with different events",
                "call make_private with the same settings (σ or targets, C, batch size, dataset, sampling)",
            )
        try:
            accountant = make_accountant(self.accountant_name)
            for record in state["ledger"]:
                accountant.compose(event_from_dict(record["event"]), int(record["count"]))
            steps = int(state["steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                "state.ledger",
                type(exc).__name__,
                "the saved privacy history is unreadable",
                "pass an intact state",
            ) from exc
        saved_randomness = state.get("randomness", "secure" if state.get("secure_rng", False) else "seeded")
        restore_rng = self._randomness == "seeded" and saved_randomness == "seeded"
        if restore_rng:
            self.noise_source.load_state_dict(state["noise_rng"])
        sampler_token = dict(state["sampler"])
        if not restore_rng:
            sampler_token["rng"] = None
        self._loader.load_state_dict(sampler_token)
        self.accountant = accountant
        self._steps = steps


def _run_length(events: tuple[PrivacyEvent, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous: PrivacyEvent | None = None
    for event in events:
        if previous is not None and event == previous:
            out[-1]["count"] += 1
        else:
            out.append({"event": event.to_dict(), "count": 1})
            previous = event
    return out


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
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
