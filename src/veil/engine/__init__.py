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
event into ``engine.accountant`` before its update is written, and releases a logical batch drawn
for it alone (a second ``optimizer.step()`` with no new batch from the loader is refused before its
noise or its event; an unreleased logical batch's clipped sums are dropped: :mod:`veil.optimizer`):

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

The facade is thin; each concern has its module: :mod:`~veil.engine.randomness` (secure or seeded),
:mod:`~veil.engine.planning` (arguments checked, σ given or calibrated, the plan fixed),
:mod:`~veil.engine.wrapping` (model, optimizer and loader checked, then their private forms built),
:mod:`~veil.engine.account` (the accounting hook), :mod:`~veil.engine.state` (checkpoint state) and
:mod:`~veil.engine.ranks` (a run across ranks, as the engine sees it; a caller may pass its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from veil.accounting.base import AccountantName, PrivacyAccountant, make_accountant
from veil.compat import opacus_args
from veil.engine import planning, wrapping
from veil.engine.account import StepAccount
from veil.engine.randomness import Randomness, child_seeds, resolve_randomness
from veil.engine.ranks import RankContext, resolve_ranks
from veil.engine.state import read_state, write_state
from veil.engine.wrapping import PrivateTraining, PrivateTrainingWithCriterion
from veil.errors import CheckpointError, ConfigError
from veil.mixing_probe import refuse_example_mixing
from veil.optimizer import DPOptimizer
from veil.per_example_loss import check_criterion
from veil.plan import PrivacyPlan, Sampling
from veil.sampling import PrivateDataLoader

if TYPE_CHECKING:
    from veil.clipping import PerSampleClipper
    from veil.engine.planning import Sizes
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "PrivacyEngine",
    "PrivacyPlan",
    "PrivateTraining",
    "PrivateTrainingWithCriterion",
    "RankContext",
    "refuse_example_mixing",
]


class _Checked(NamedTuple):
    """What ``make_private``'s checks settled, for the build that follows them."""

    module: nn.Module
    ranks: RankContext | None
    plan: PrivacyPlan
    sizes: Sizes
    collate: Any
    probe: str
    noise_seed: int | None
    template: Any


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

    The budget registry is not consulted: ε here is this engine's alone, and nothing records it against
    the dataset (the engine is never told which dataset it is, nor when the run ends). A loop that
    should be charged and refused over its dataset's budget builds its engine through
    :class:`veil.pipeline.external.ExternalRun`, as the Hugging Face and Lightning adapters do
    (``docs/budget.md``, "Your own training loop").
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
        randomness = resolve_randomness(secure_rng, seed, reproducible)
        from veil.mechanisms.rng import make_source

        self._account = StepAccount(make_accountant(accountant))
        self.accountant_name: AccountantName = accountant
        self._randomness: Randomness = randomness
        self.secure_rng = randomness == "secure"
        noise_seed, sampler_seed = child_seeds(seed)
        self.noise_source: RandomSource = make_source(self.secure_rng, noise_seed)
        self.sampler_source: RandomSource = make_source(self.secure_rng, sampler_seed)
        self.plan: PrivacyPlan | None = None
        self.forward_probe: str | None = None
        self._optimizer: DPOptimizer | None = None
        self._loader: PrivateDataLoader | None = None
        self._clipper: PerSampleClipper | None = None
        self.distributed: RankContext | None = None

    @property
    def accountant(self) -> PrivacyAccountant:
        """The accountant every logical step is composed into (rebuilt by :meth:`load_state_dict`)."""
        return self._account.accountant

    @accountant.setter
    def accountant(self, accountant: PrivacyAccountant) -> None:
        self._account.accountant = accountant

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
        distributed: bool | RankContext | None = None,
        unit_ids: Sequence[Any] | None = None,
        max_rows_per_unit: int | None = None,
        population: int | None = None,
    ) -> PrivateTraining | PrivateTrainingWithCriterion:
        """Make ``module``/``optimizer``/``data_loader`` private; returns ``(model, optimizer, loader)``.

        Give either ``noise_multiplier`` or ``target_epsilon`` + ``target_delta`` + ``epochs`` (σ is then
        calibrated, on the private side of the target, for ``epochs × ⌈N/B⌉`` steps). ``loss_reduction``
        defaults to the criterion's ``reduction`` when a criterion is passed, else ``"mean"``. The loss
        must be a fixed-coefficient sum of per-example terms (see :mod:`veil.per_example_loss`): a
        ``criterion`` with ``weight=`` and ``reduction="mean"`` is refused; with ``"mean"`` a
        cross-entropy's ignored targets add nothing and the divisor stays the number of targets
        (the loss guard computes the mean over a fixed count; no batch is refused for a value). Everything
        is checked before anything changes; a refusal leaves the model, optimizer and engine untouched.
        The returned model is ``module`` itself (with the clipper's hooks); the optimizer wraps
        ``optimizer``; the loader replaces ``data_loader`` with Poisson-sampled logical batches of expected
        size ``data_loader.batch_size`` over the same dataset, collate function and workers.

        Opacus's arguments (``batch_first``, ``grad_sample_mode``, ``noise_generator``, ``wrap_model``,
        ``rand_on_empty``) are checked by :mod:`veil.compat.opacus_args`; ``grad_sample_mode="ghost"``
        returns ``(model, optimizer, criterion, loader)`` as Opacus does.

        Across ranks (a ``DistributedDataParallel`` module, ``distributed=True`` under an initialised
        process group, or a :class:`~veil.engine.ranks.RankContext` built by the caller; see
        :mod:`veil.distributed`): ``data_loader.batch_size`` is the *global* expected
        batch size, each rank's loader yields its shard of every logical batch, the returned model is
        the inner (unwrapped) module, and the clipped sums are all-reduced once per logical step.

        Privacy units (``unit_ids``: one hashable id per row of ``data_loader.dataset``, in dataset
        order; see :mod:`veil.units`): the guarantee protects every row sharing an id at once.
        ``data_loader.batch_size`` is then the expected number of *units* per step, q = batch_size /
        (number of distinct ids), each sampled unit contributes at most ``max_rows_per_unit`` rows (K;
        default :func:`veil.units.default_max_rows_per_unit`), the mean of its rows' gradients is
        clipped once to C, and δ is checked against 1/(number of units). ``physical_batch_size``
        counts rows, and a chunk never splits a unit. Poisson sampling in one process only.

        ``population``: a public number of records (or units) the rate is computed against, q =
        batch_size / population with ⌈population / batch_size⌉ steps per epoch, while each record of
        the dataset is drawn at that q (Poisson, one process): for data whose exact size is private
        (:func:`veil.engine.planning.sizes`). Default: the dataset's own size. With a population the
        dataset may hold 0 rows: every planned step is taken on empty batches (noise alone) and
        accounted, never refused on that size; empty batches are shaped from the dataset's structure
        (:func:`veil.engine.wrapping.template_item`: a ``TensorDataset`` or a ``template_item()``
        method, else refused whatever the size).

        No budget registry is opened or charged (see the class doc): use
        :class:`veil.pipeline.external.ExternalRun` for a run charged to its dataset.
        """
        self._refuse_second_run()
        opacus_args.check_make_private_args(
            batch_first=batch_first,
            grad_sample_mode=grad_sample_mode,
            clipping=clipping,
            max_grad_norm=max_grad_norm,
            wrap_model=wrap_model,
            rand_on_empty=rand_on_empty,
        )
        noise_seed = opacus_args.check_noise_generator(noise_generator, not self.noise_source.secure)
        checked = self._check(
            module, optimizer, data_loader, max_grad_norm, noise_multiplier,
            (target_epsilon, target_delta, epochs), clipping, loss_reduction, criterion, physical_batch_size,
            (poisson_sampling, allow_non_poisson), distributed, unit_ids, max_rows_per_unit, noise_seed,
            population,
        )  # fmt: skip
        model, dp_optimizer, loader = self._build(checked, optimizer, data_loader, physical_batch_size)
        if opacus_args.returns_criterion(grad_sample_mode):
            reduction = checked.plan.loss_reduction
            return PrivateTrainingWithCriterion(
                model, dp_optimizer, criterion or nn.CrossEntropyLoss(reduction=reduction), loader
            )
        return PrivateTraining(model, dp_optimizer, loader)

    def _refuse_second_run(self) -> None:
        if self.plan is not None:
            raise ConfigError(
                "make_private",
                "called twice",
                "one engine accounts for one training run; a second model on the same accountant would "
                "entangle two runs' checkpoints",
                "create one PrivacyEngine per model",
            )

    def _check(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        max_grad_norm: float,
        noise_multiplier: float | None,
        targets: tuple[float | None, float | None, float | None],
        clipping: Literal["flat", "per_layer"],
        loss_reduction: Literal["mean", "sum"] | None,
        criterion: nn.Module | None,
        physical_batch_size: int | None,
        sampling_flags: tuple[bool, bool],
        distributed: bool | RankContext | None,
        unit_ids: Sequence[Any] | None,
        max_rows_per_unit: int | None,
        noise_seed: int | None,
        population: int | None = None,
    ) -> _Checked:
        """Every check of ``make_private``, in order; nothing is built or changed (see its docstring)."""
        wrapping.check_module_type(module)
        ranks = resolve_ranks(module, distributed)  # None in one process
        if ranks is not None:
            module = ranks.module  # DDP's own averaging must never see unclipped gradients
        wrapping.check_optimizer_type(optimizer)
        planning.check_clip(max_grad_norm, clipping)
        wrapping.check_physical_batch_size(physical_batch_size)
        reduction = planning.resolve_loss_reduction(loss_reduction, criterion)
        check_criterion(criterion, reduction)
        sampling = planning.check_sampling(*sampling_flags)
        if ranks is not None:
            ranks.check_sampling(sampling)
            ranks.check_loader(data_loader)
        _, n, batch_size = planning.check_data_loader(data_loader)
        sizes = planning.sizes(
            n, batch_size, sampling, unit_ids, max_rows_per_unit, ranks is not None, population
        )
        template = wrapping.template_item(data_loader.dataset, population)
        wrapping.check_optimizer(module, optimizer)
        # With a population the dataset's size is private: the probe is shaped from the structural
        # template, never skipped on the size (a verdict that would depend on one record).
        probe = wrapping.check_model(module, data_loader, template if population is not None else None)
        # Last among the checks: calibration can take seconds.
        sigma = planning.noise_multiplier(noise_multiplier, targets, sizes, sampling, self.accountant_name)
        plan = planning.make_plan(
            sigma, max_grad_norm, sizes, sampling, clipping, reduction, self.accountant_name
        )
        planning.check_accountant(self.accountant, self.accountant_name, plan)
        if ranks is not None:
            ranks.agree(plan)  # a collective: every rank refuses together
        return _Checked(module, ranks, plan, sizes, data_loader.collate_fn, probe, noise_seed, template)

    def _build(
        self,
        checked: _Checked,
        optimizer: Optimizer,
        data_loader: DataLoader,
        physical_batch_size: int | None,
    ) -> tuple[nn.Module, DPOptimizer, PrivateDataLoader]:
        """Every check passed: build the clipper, the loader and the optimizer, and commit."""
        module, ranks, plan = checked.module, checked.ranks, checked.plan
        if ranks is not None:
            ranks.broadcast_parameters()
        from veil.clipping import PerSampleClipper

        clipper = PerSampleClipper(
            module, plan.max_grad_norm, clipping=plan.clipping, loss_reduction=plan.loss_reduction
        )
        loader, signal = wrapping.private_loader(
            data_loader,
            checked.collate,
            plan,
            checked.sizes,
            ranks,
            self.sampler_source,
            physical_batch_size,
            checked.template,
        )
        if checked.noise_seed is not None:
            from veil.mechanisms.rng import make_source

            self.noise_source = make_source(False, checked.noise_seed)
        self._account.plan = plan
        dp_optimizer = wrapping.private_optimizer(
            optimizer, clipper, plan, ranks, self.noise_source, signal, on_release=self._account
        )
        if ranks is not None:
            ranks.guard_wrapper()
        self.distributed = ranks
        self.plan = plan
        self.forward_probe = checked.probe
        if checked.sizes.units is not None:
            from veil.units import unit_setter

            loader.on_units = unit_setter(clipper)
        self._clipper, self._optimizer, self._loader = clipper, dp_optimizer, loader
        return module, dp_optimizer, loader

    # -- queries -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Logical steps (noisy updates) taken so far, each composed into the accountant."""
        return self._account.steps

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
        """ε at ``delta`` for every step taken so far **by this engine** (∞ if any step was
        non-private, i.e. σ = 0): not the dataset's total over other runs, which only the budget
        registry composes, and which this engine does not charge (see the class doc).

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
        return write_state(
            self.plan,
            self.steps,
            self.accountant,
            self._randomness,
            self._optimizer,
            self._loader,
            self.noise_source,
        )

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
        restored = read_state(state, self.plan, self.accountant_name, self._randomness)
        if restored.restore_rng:
            self.noise_source.load_state_dict(restored.noise_rng)
        self._loader.load_state_dict(restored.sampler)
        self._account.restore(restored.accountant, restored.steps)
