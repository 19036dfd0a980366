"""The Opacus names one by one: what each maps to in veil, and what veil refuses (the Opacus habit named)."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil import PrivacyEngine
from veil.accountants import PRVAccountant, RDPAccountant, create_accountant, dpsgd_history
from veil.accountants.utils import get_noise_multiplier
from veil.accounting.calibrate import calibrate_noise, dpsgd_epsilon
from veil.accounting.events import Gaussian, Laplace, NonPrivate, PoissonSampled, SelfComposed
from veil.errors import InvalidParameterError, ModelNotSupportedError, SamplingError, UnsupportedEventError
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.utils.batch_memory_manager import BatchMemoryManager
from veil.validators import ModuleValidator


def _setup(
    n: int = 40, batch: int = 10, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=batch)


def _private(engine: PrivacyEngine, **kwargs: object) -> tuple:
    model, optimizer, loader = _setup()
    args = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **kwargs}
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, **args)


def _research_engine(seed: int) -> PrivacyEngine:
    """An engine whose noise is seeded on purpose (research mode, however this version spells it)."""
    params = inspect.signature(PrivacyEngine).parameters
    extra = {"reproducible": True} if "reproducible" in params else {}
    engine = PrivacyEngine(seed=seed, **extra)
    assert not engine.noise_source.secure
    return engine


def _one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> None:
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


# -- PrivacyEngine(accountant=..., secure_mode=...) ------------------------------------------------


def test_prv_is_pld_and_gdp_is_refused_as_under_reporting() -> None:
    assert PrivacyEngine(accountant="prv").accountant_name == "pld"
    assert PrivacyEngine(accountant="rdp").accountant_name == "rdp"
    with pytest.raises(InvalidParameterError, match="under-reports") as err:
        PrivacyEngine(accountant="gdp")
    assert "accountant='prv'" in str(err.value)


def test_secure_mode_true_draws_from_the_os_and_refuses_a_seed() -> None:
    engine = PrivacyEngine(secure_mode=True)
    assert isinstance(engine.noise_source, SecureSource) and isinstance(engine.sampler_source, SecureSource)
    with pytest.raises(InvalidParameterError, match="secure_mode=True"):
        PrivacyEngine(secure_mode=True, seed=0)


def test_secure_mode_false_does_not_change_veils_noise() -> None:
    plain, opacus_style = PrivacyEngine(), PrivacyEngine(secure_mode=False)
    assert type(plain.noise_source) is type(opacus_style.noise_source)
    assert type(plain.sampler_source) is type(opacus_style.sampler_source)


def test_seeded_noise_generator_refused_outside_research_mode() -> None:
    engine = PrivacyEngine(secure_mode=True)
    with pytest.raises(InvalidParameterError, match="Opacus seeds DP-SGD noise") as err:
        _private(engine, noise_generator=torch.Generator().manual_seed(0))
    assert "reproducible" in err.value.fix
    assert engine.plan is None  # nothing changed


def test_noise_generator_in_research_mode_seeds_the_noise_reproducibly() -> None:
    def update(noise_seed: int) -> list[torch.Tensor]:
        engine = _research_engine(5)
        model, optimizer, loader = _private(engine, noise_generator=torch.Generator().manual_seed(noise_seed))
        assert isinstance(engine.noise_source, SeededSource) and engine.noise_source.seed == noise_seed
        _one_epoch(model, optimizer, loader)
        return [p.detach().clone() for p in model.parameters()]

    a, b, c = update(7), update(7), update(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_noise_generator_already_drawn_from_is_refused() -> None:
    gen = torch.Generator().manual_seed(3)
    torch.randn(2, generator=gen)
    with pytest.raises(InvalidParameterError, match="drawn from"):
        _private(_research_engine(0), noise_generator=gen)


# -- make_private's Opacus arguments and return shapes ---------------------------------------------


def test_make_private_accepts_opacus_keywords_and_returns_three() -> None:
    """Each Opacus keyword means in the plan what it means in Opacus: σ, C, q = B/N, Poisson
    sampling, flat clipping, the loss reduction (``sum`` here, not the default, so ignoring the
    keyword fails), hooks on the module itself; one epoch charges ⌈N/B⌉ PoissonSampled(q, σ) steps."""
    from veil.accounting.calibrate import dpsgd_event
    from veil.optimizer import DPOptimizer
    from veil.sampling import PoissonBatchSampler, PrivateDataLoader

    engine = PrivacyEngine(accountant="rdp")
    module, opt, data = _setup()  # 40 examples, batch_size 10
    model, optimizer, loader = engine.make_private(
        module=module,
        optimizer=opt,
        data_loader=data,
        noise_multiplier=1.3,
        max_grad_norm=0.7,
        batch_first=True,
        loss_reduction="sum",
        poisson_sampling=True,
        clipping="flat",
        grad_sample_mode="hooks",
        criterion=nn.CrossEntropyLoss(reduction="sum"),
        wrap_model=True,
    )
    plan = engine.plan
    assert plan is not None
    assert (plan.noise_multiplier, plan.max_grad_norm) == (1.3, 0.7)
    assert (plan.sampling_rate, plan.expected_batch_size, plan.dataset_size) == (10 / 40, 10, 40)
    assert (plan.sampling, plan.clipping, plan.loss_reduction) == ("poisson", "flat", "sum")
    assert plan.steps_per_epoch == 4 and plan.event == dpsgd_event(0.25, 1.3)
    assert model is module  # wrap_model: the hooks sit on the module itself
    assert isinstance(optimizer, DPOptimizer) and optimizer.original_optimizer is opt
    assert (optimizer.noise_multiplier, optimizer.max_grad_norm, optimizer.expected_batch_size) == (
        1.3,
        0.7,
        10,
    )
    assert optimizer.clipper.loss_reduction == "sum" and optimizer.clipper.max_grad_norms == [0.7]
    assert isinstance(loader, PrivateDataLoader) and loader.expected_batch_size == 10
    sampler = loader.logical_sampler
    assert isinstance(sampler, PoissonBatchSampler) and sampler.sampling_rate == 0.25
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 4
    assert engine.get_epsilon(1e-5) == pytest.approx(dpsgd_epsilon(0.25, 1.3, 4, 1e-5, "rdp"), rel=1e-9)


def test_ghost_mode_returns_four_with_a_usable_criterion() -> None:
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = _private(
        engine, grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    )
    assert isinstance(criterion, nn.CrossEntropyLoss) and criterion.reduction == "sum"
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"batch_first": False}, InvalidParameterError, "dimension 0"),
        ({"clipping": "adaptive"}, InvalidParameterError, "adaptive clipping"),
        ({"max_grad_norm": [0.6, 0.8]}, InvalidParameterError, "max_grad_norm=1"),
        ({"grad_sample_mode": "no_op"}, InvalidParameterError, "grad_sample_mode"),
        ({"rand_on_empty": True}, InvalidParameterError, "empty Poisson batch"),
        ({"poisson_sampling": False}, SamplingError, "Opacus"),
    ],
)
def test_opacus_habits_veil_refuses_are_named(kwargs: dict, error: type, words: str) -> None:
    engine = PrivacyEngine()
    with pytest.raises(error, match=words):
        _private(engine, **kwargs)
    assert engine.plan is None


def test_poisson_false_with_opt_in_is_accounted_without_amplification() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine, poisson_sampling=False, allow_non_poisson=True)
    _one_epoch(model, optimizer, loader)
    assert [tuple(h) for h in engine.accountant.history] == [(0.5, 1.0, 4)]


def test_make_private_with_epsilon_calibrates_and_refuses_delta_above_one_over_n() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _setup()
    with pytest.raises(InvalidParameterError, match="Opacus accepts any δ"):
        engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader,
            target_epsilon=3.0, target_delta=1e-1, epochs=2, max_grad_norm=1.0,
        )  # fmt: skip
    assert engine.plan is None
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader,
        target_epsilon=3.0, target_delta=1e-3, epochs=2, max_grad_norm=1.0,
    )  # fmt: skip
    assert optimizer.noise_multiplier == pytest.approx(calibrate_noise(3.0, 1e-3, 0.25, 8), rel=1e-12)
    for _ in range(2):
        _one_epoch(model, optimizer, loader)
    assert engine.get_epsilon(1e-3) <= 3.0
    with pytest.raises(InvalidParameterError, match="1/N"):
        engine.get_epsilon(0.05)


# -- accountants -----------------------------------------------------------------------------------


def test_accountant_get_epsilon_and_history_track_the_engine() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    _one_epoch(model, optimizer, loader)
    assert engine.accountant.get_epsilon(delta=1e-3) == engine.get_epsilon(1e-3)
    assert engine.accountant.get_epsilon(1e-3) == pytest.approx(dpsgd_epsilon(0.25, 1.0, 4, 1e-3), rel=1e-9)
    assert engine.accountant.history == [(1.0, 0.25, 4)]


def test_history_view_merges_runs_and_refuses_other_events() -> None:
    step = PoissonSampled(0.1, Gaussian(2.0))
    events = [step, SelfComposed(step, 3), Gaussian(1.0), NonPrivate()]
    assert dpsgd_history(events) == [(2.0, 0.1, 4), (1.0, 1.0, 1), (0.0, 1.0, 1)]
    with pytest.raises(UnsupportedEventError, match="ledger"):
        dpsgd_history([Laplace(1.0)])


@pytest.mark.parametrize(("cls", "name"), [(PRVAccountant, "pld"), (RDPAccountant, "rdp")])
def test_standalone_accountants_step_like_opacus(cls: type, name: str) -> None:
    acc = create_accountant("prv" if name == "pld" else "rdp")
    assert isinstance(acc, cls)
    for _ in range(20):
        acc.step(noise_multiplier=1.2, sample_rate=0.05)
    assert acc.get_epsilon(delta=1e-5) == pytest.approx(dpsgd_epsilon(0.05, 1.2, 20, 1e-5, name), rel=1e-9)
    assert len(acc) == 1 and acc.history == [(1.2, 0.05, 20)]
    acc.step(noise_multiplier=0.0, sample_rate=0.05)
    assert math.isinf(acc.get_epsilon(1e-5))


def test_get_noise_multiplier_is_veils_calibration() -> None:
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, epochs=3)
    assert sigma == calibrate_noise(2.0, 1e-5, 0.01, 300, accountant="rdp")
    assert dpsgd_epsilon(0.01, sigma, 300, 1e-5, "rdp") <= 2.0
    prv = get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=300, accountant="prv"
    )
    assert prv == calibrate_noise(2.0, 1e-5, 0.01, 300, accountant="pld") and prv < sigma
    with pytest.raises(InvalidParameterError, match="under-reports"):
        get_noise_multiplier(
            target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=10, accountant="gdp"
        )
    with pytest.raises(InvalidParameterError, match="exactly one"):
        get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01)


def test_get_noise_multiplier_close_to_opacus() -> None:
    """Opacus's RDP search and veil's agree on σ to a few percent (veil's is never below the need)."""
    utils = pytest.importorskip("opacus.accountants.utils")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = utils.get_noise_multiplier(
            target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=300, accountant="rdp"
        )
    ours = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=300)
    assert ours == pytest.approx(theirs, rel=0.03)


# -- ModuleValidator, BatchMemoryManager -------------------------------------------------------------


def test_module_validator_lists_raises_and_fixes() -> None:
    model = nn.Sequential(nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6), nn.ReLU())
    problems = ModuleValidator.validate(model, strict=False)
    assert [p.location for p in problems] == ["1"]
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(ModelNotSupportedError, match="BatchNorm2d"):
        ModuleValidator.validate(model, strict=True)
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed[1], nn.GroupNorm) and isinstance(model[1], nn.BatchNorm2d)  # a copy
    assert ModuleValidator.is_valid(fixed) and ModuleValidator.validate(fixed) == []
    assert isinstance(ModuleValidator.fix_and_validate(model)[1], nn.GroupNorm)


def test_batch_memory_manager_chunks_without_changing_privacy() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _private(engine)
    plan = engine.plan
    sizes = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as safe:
        assert safe is loader
        for x, y in safe:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            sizes.append(len(x))
    assert max(sizes) <= 3 and len(sizes) > 4
    assert engine.steps == 4 and engine.plan == plan  # one noisy step per logical batch
    assert loader.physical_batch_size is None  # restored
    assert engine.accountant.history == [(1.0, 0.25, 4)]


def test_batch_memory_manager_refuses_foreign_objects() -> None:
    engine = PrivacyEngine()
    _, optimizer, loader = _private(engine)
    other = PrivacyEngine()
    _, other_optimizer, _ = _private(other)
    with pytest.raises(InvalidParameterError, match="same make_private"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=other_optimizer)
    with pytest.raises(InvalidParameterError, match=r"returned by PrivacyEngine\.make_private"):
        BatchMemoryManager(data_loader=_setup()[2], max_physical_batch_size=2, optimizer=optimizer)


def test_checkpoint_without_engine_state_is_refused(tmp_path) -> None:
    from veil.errors import CheckpointError

    path = tmp_path / "opacus_style.pt"
    model, _, _ = _private(PrivacyEngine())
    torch.save({"module_state_dict": model.state_dict(), "privacy_accountant_state_dict": {}}, path)
    engine = PrivacyEngine()
    model2, optimizer2, _ = _private(engine)
    with pytest.raises(CheckpointError, match="not veil's ledger"):
        engine.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    with pytest.raises(InvalidParameterError, match="noise_scheduler"):
        engine.save_checkpoint(path=path, module=model2, noise_scheduler=object())
