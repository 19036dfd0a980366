"""PrivacyEngine / DPOptimizer: exactness against a naive per-example loop, noise scale, accounting,
virtual batches, secure mode, checkpoints, and every refusal."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import veil
from veil.accounting.calibrate import calibrate_noise, dpsgd_epsilon
from veil.accounting.events import Gaussian, NonPrivate, PoissonSampled
from veil.engine import PrivacyEngine, PrivateTraining
from veil.errors import (
    CheckpointError,
    ConfigError,
    InvalidParameterError,
    ModelNotSupportedError,
    SamplingError,
    VeilError,
)
from veil.optimizer import DPOptimizer
from veil.sampling import PrivateDataLoader

# ---------------------------------------------------------------------------------------------
# helpers


def _data(n: int = 40, features: int = 6, dtype: torch.dtype = torch.float64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(x, y)


def _mlp(features: int = 6, dtype: torch.dtype = torch.float64, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _private(
    model: nn.Module | None = None,
    *,
    opt: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.1),
    data: TensorDataset | None = None,
    batch_size: int = 8,
    engine: PrivacyEngine | None = None,
    **kwargs: Any,
) -> tuple[PrivacyEngine, PrivateTraining]:
    model = model if model is not None else _mlp()
    engine = engine or PrivacyEngine(seed=0, reproducible=True)
    kwargs.setdefault("max_grad_norm", 1.0)
    if "target_epsilon" not in kwargs:
        kwargs.setdefault("noise_multiplier", 1.0)
    loader = DataLoader(data if data is not None else _data(), batch_size=batch_size, shuffle=True)
    out = engine.make_private(module=model, optimizer=opt(model.parameters()), data_loader=loader, **kwargs)
    return engine, out


def _train(pt: PrivateTraining, steps: int | None = None, reduction: str = "mean") -> int:
    """Run until ``steps`` logical steps (or one epoch); returns logical steps taken."""
    model, optimizer, loader = pt
    crit = nn.CrossEntropyLoss(reduction=reduction)
    done = 0
    for x, y in loader:
        optimizer.zero_grad()
        crit(model(x), y).backward()
        optimizer.step()
        done += int(loader.signal.last_chunk)
        if steps is not None and done == steps:
            break
    return done


def _naive_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float,
    denom: float,
) -> None:
    """Reference: batch of one per example, clip its gradient, sum, divide by q·N, user's optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, clip / float(norm)) if float(norm) > 0 else 1.0
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    for p, t in zip(params, total, strict=True):
        p.grad = t / denom
    optimizer.step()


def _no_hooks(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules()
    )


# ---------------------------------------------------------------------------------------------
# facade


def test_make_private_returns_one_type_that_unpacks() -> None:
    model = _mlp()
    engine, pt = _private(model)
    assert isinstance(pt, PrivateTraining)
    m, optimizer, loader = pt
    assert m is model
    assert isinstance(optimizer, DPOptimizer) and isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(loader, PrivateDataLoader) and loader.expected_batch_size == 8
    assert engine.sampling == "poisson" and engine.sampling_rate == 8 / 40
    assert engine.forward_probe == "passed"
    before = {id(p): dict(p.__dict__) for p in model.parameters()}
    _train(pt, steps=2)
    assert {id(p): dict(p.__dict__) for p in model.parameters()} == before  # nothing patched onto params
    assert engine.steps == 2


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0.05),
    ],
    ids=["sgd", "adam"],
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sigma_zero_step_equals_naive_per_example_loop(
    make_opt: Callable[[Any], Any], reduction: str
) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference.parameters())
    clip = 1.5  # some examples clipped, some not (checked below)
    engine, pt = _private(
        model,
        opt=make_opt,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        criterion=nn.CrossEntropyLoss(reduction=reduction),
    )
    _, optimizer, loader = pt
    crit = nn.CrossEntropyLoss(reduction=reduction)
    norms: list[float] = []
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        crit(model(x), y).backward()
        optimizer.step()
        for i in range(len(x)):
            loss = nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1], reduction="sum")
            norms.append(
                float(
                    torch.sqrt(
                        sum((g**2).sum() for g in torch.autograd.grad(loss, list(reference.parameters())))
                    )
                )
            )
        _naive_step(reference, ref_opt, x, y, clip, 8.0)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)
        if step == 2:
            break
    assert min(norms) < clip < max(norms)
    assert engine.steps == 3 and math.isinf(engine.get_epsilon(1e-5))


def test_virtual_batches_give_the_same_update_and_accounting() -> None:
    results = []
    for physical in (None, 3, 1):
        model = _mlp()
        engine, pt = _private(model, noise_multiplier=0.0, physical_batch_size=physical, batch_size=10)
        assert _train(pt, steps=3) == 3
        results.append(([p.detach().clone() for p in model.parameters()], engine.accountant.ledger))
    for params, ledger in results[1:]:
        assert ledger == results[0][1]
        for p, r in zip(params, results[0][0], strict=True):
            torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)


def test_dropout_is_not_mistaken_for_mixing_examples() -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3)).double()
    engine, pt = _private(model)
    assert engine.forward_probe == "passed"
    assert _train(pt, steps=1) == 1


def test_chunk_steps_do_not_update_until_the_logical_batch_closes() -> None:
    model = _mlp()
    _, (m, optimizer, loader) = _private(model, physical_batch_size=1, batch_size=10)
    crit = nn.CrossEntropyLoss()
    before = [p.detach().clone() for p in m.parameters()]
    for x, y in loader:
        optimizer.zero_grad()
        crit(m(x), y).backward()
        optimizer.step()
        if loader.signal.last_chunk:
            break
        assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
        assert optimizer.pending_chunks > 0
    assert optimizer.pending_chunks == 0
    assert not all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))


# ---------------------------------------------------------------------------------------------
# noise


_SIGMA, _CLIP, _BATCH = 1.3, 0.7, 16


def _pure_noise_grads(
    model: nn.Module, dtype: torch.dtype, doctor: bool = False, std_factor: float = 1.0, features: int = 100
) -> list[torch.Tensor]:
    """One logical step on a zero loss, so that every p.grad is pure noise (std × ``std_factor``)."""
    sigma, clip, batch = _SIGMA, _CLIP, _BATCH
    data = TensorDataset(torch.randn(64, features, dtype=dtype))
    engine = PrivacyEngine(seed=123, reproducible=True)
    m, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        loss_reduction="sum",
        physical_batch_size=4,
    )
    if doctor:  # the classic bug: divide by the physical batch size instead of q·N
        optimizer._denominator = 4.0
    optimizer.noise_multiplier *= std_factor  # a deliberately wrong noise scale (1.0: none)
    for (x,) in loader:
        optimizer.zero_grad()
        (m(x) * 0).sum().backward()
        optimizer.step()
        if loader.signal.last_chunk:
            break
    return [p.grad for p in m.parameters() if p.grad is not None]


def _noise_statistic(
    dtype: torch.dtype, doctor: bool = False, variance_factor: float = 1.0
) -> tuple[float, float, int]:
    """(Σg², expected variance per coordinate, number of coordinates) of one step's noise.

    100 250 coordinates (Linear(400, 250)): Σg²/var ~ χ²_n has relative sd √(2/n) = 0.45 %, so the
    central 1 − 1e-6 window is ±2.2 % and a 5 % error in the variance lies ≥ 6 sd outside it."""
    torch.manual_seed(0)
    model = nn.Linear(400, 250).to(dtype)
    grads = _pure_noise_grads(model, dtype, doctor, std_factor=math.sqrt(variance_factor), features=400)
    g = torch.cat([t.double().flatten() for t in grads])
    return float((g**2).sum()), (_SIGMA * _CLIP / _BATCH) ** 2, g.numel()


def _chi2_accepts(ss: float, var: float, n: int) -> bool:
    """Σg²/var inside the central 1 − 1e-6 of χ²_n: the false-failure rate of a correct scale is 1e-6."""
    return bool(stats.chi2.ppf(5e-7, n) < ss / var < stats.chi2.ppf(1 - 5e-7, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_noise_std_is_sigma_c_over_expected_batch(dtype: torch.dtype) -> None:
    # bfloat16 rounding shifts the statistic by ~1e-5 relative, far inside the ±2.2 % window.
    assert _chi2_accepts(*_noise_statistic(dtype))


@pytest.mark.parametrize("variance_factor", [0.95, 1.05])
def test_noise_test_catches_a_five_percent_variance_error(variance_factor: float) -> None:
    assert not _chi2_accepts(*_noise_statistic(torch.float32, variance_factor=variance_factor))


def test_noise_scale_per_parameter_when_dtypes_are_mixed() -> None:
    """One draw per dtype: each parameter keeps its dtype and gets noise of std σC/B."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low = nn.Linear(100, 50)
            self.high = nn.Linear(100, 50).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.low(x.float()).double() + self.high(x.double())

    torch.manual_seed(0)
    model = Mixed()
    grads = _pure_noise_grads(model, torch.float64)
    assert [g.dtype for g in grads] == [p.dtype for p in model.parameters()]
    var = (_SIGMA * _CLIP / _BATCH) ** 2
    for g in (
        torch.cat([t.double().flatten() for t in grads[:2]]),
        torch.cat([t.flatten() for t in grads[2:]]),
    ):
        n = g.numel()  # χ²_n acceptance in the central 1 − 1e-6 for each dtype group (false failure 2e-6)
        assert stats.chi2.ppf(5e-7, n) < float((g.double() ** 2).sum()) / var < stats.chi2.ppf(1 - 5e-7, n)


def test_noise_test_rejects_a_wrong_scale() -> None:
    ss, var, n = _noise_statistic(torch.float64, doctor=True)
    assert ss / var > stats.chi2.ppf(1 - 5e-7, n)  # 16× the variance: rejected


def test_noise_is_added_once_per_logical_step() -> None:
    engine = PrivacyEngine(seed=0, reproducible=True)
    calls: list[tuple[int, ...]] = []
    real = engine.noise_source.normal

    def spy(shape: tuple[int, ...], std: float, **kw: Any) -> torch.Tensor:
        calls.append(shape)
        return real(shape, std, **kw)

    engine.noise_source.normal = spy  # type: ignore[method-assign]
    model = _mlp()
    _, pt = _private(model, engine=engine, physical_batch_size=2, batch_size=10)
    assert _train(pt, steps=2) == 2
    # one draw per logical step covering every parameter coordinate (all float32 here)
    assert calls == [(sum(p.numel() for p in model.parameters()),)] * 2
    assert engine.steps == 2 and len(engine.accountant.ledger.events) == 2


def _global_rng_states() -> tuple[Any, ...]:
    """Every global generator a careless noise source could draw from (torch, numpy, random)."""
    return (
        torch.get_rng_state().clone(),
        json.dumps(np.random.get_state(legacy=False), default=str),
        random.getstate(),
    )


def _steps_that_consume_global_rng(engine: PrivacyEngine, steps: int = 3) -> list[int]:
    """Logical steps (1-based) whose forward/backward/optimizer step advanced a global generator.

    The loader is advanced outside the window (torch's DataLoader draws a worker base seed from the
    global generator when an iterator starts; that is not noise), and the model has no dropout, so
    only the engine's noise and clipping run inside it."""
    _, (model, optimizer, loader) = _private(_mlp(), engine=engine, physical_batch_size=3)
    # Every draw inside the window: a draw made ahead runs on a worker thread after the step (the same
    # source method, at a time the window cannot pin down).
    optimizer.draw_ahead = False
    crit = nn.CrossEntropyLoss()
    consumed, done = [], 0
    for x, y in loader:
        before = _global_rng_states()
        optimizer.zero_grad()
        crit(model(x), y).backward()
        optimizer.step()
        after = _global_rng_states()
        if not (torch.equal(before[0], after[0]) and before[1:] == after[1:]):
            consumed.append(done + 1)
        done += int(loader.signal.last_chunk)
        if done == steps:
            break
    return consumed


def test_the_default_engine_is_secure_and_release_ready() -> None:
    engine = PrivacyEngine()
    assert engine.randomness == "secure" and engine.release_ready and engine.secure_rng
    assert engine.noise_source.secure and engine.sampler_source.secure
    for research in (
        PrivacyEngine(reproducible=True),
        PrivacyEngine(seed=3, reproducible=True),
        PrivacyEngine(secure_rng=False, seed=3),
    ):
        assert research.randomness == "seeded" and not research.release_ready
        assert not research.noise_source.secure and not research.sampler_source.secure
    _private(engine=engine, noise_multiplier=0.0)
    assert not engine.release_ready  # σ = 0: secure randomness, but nothing private to release


def test_a_seed_alone_does_not_seed_the_noise() -> None:
    with pytest.raises(InvalidParameterError, match="reproducible=True"):
        PrivacyEngine(seed=0)
    with pytest.raises(InvalidParameterError, match="reproducible=True"):
        PrivacyEngine(secure_rng=True, reproducible=True)


def test_secure_noise_never_comes_from_a_global_generator() -> None:
    assert _steps_that_consume_global_rng(PrivacyEngine()) == []


def test_the_global_generator_check_catches_noise_from_torch_randn() -> None:
    """The check above can fail: the same engine with its noise drawn from torch's global generator."""
    engine = PrivacyEngine()

    def global_noise(shape: tuple[int, ...], std: float, **kw: Any) -> torch.Tensor:
        return torch.randn(shape, dtype=kw.get("dtype")) * std

    engine.noise_source.normal = global_noise  # type: ignore[method-assign]
    assert _steps_that_consume_global_rng(engine) == [1, 2, 3]


def test_secure_noise_differs_under_identical_global_seeds() -> None:
    updates = []
    for _ in range(2):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        model = _mlp()
        start = [p.detach().clone() for p in model.parameters()]
        _, pt = _private(model, engine=PrivacyEngine())
        assert _train(pt, steps=1) == 1
        updates.append(torch.cat([(p - s).flatten() for p, s in zip(model.parameters(), start, strict=True)]))
    assert not torch.equal(updates[0], updates[1])
    # ...whereas research mode replays exactly: the comparison is able to fail.
    replay = []
    for _ in range(2):
        model = _mlp()
        start = [p.detach().clone() for p in model.parameters()]
        _, pt = _private(model, engine=PrivacyEngine(seed=4, reproducible=True))
        _train(pt, steps=1)
        replay.append(torch.cat([(p - s).flatten() for p, s in zip(model.parameters(), start, strict=True)]))
    assert torch.equal(replay[0], replay[1])


def _holds_generator_state(value: Any) -> bool:
    if isinstance(value, dict):
        return any(
            k in ("noise_rng", "numpy", "torch", "seed") or _holds_generator_state(v)
            for k, v in value.items()
            if k != "plan"
        ) or (value.get("rng") is not None)
    if isinstance(value, list):
        return any(_holds_generator_state(v) for v in value)
    return False


def test_a_secure_checkpoint_holds_no_generator_state_and_resumes_with_fresh_noise() -> None:
    model, engine, pt = _resumable(engine=PrivacyEngine())
    assert _train(pt, steps=2) == 2
    saved = json.loads(json.dumps(engine.state_dict()))
    assert saved["randomness"] == "secure" and not _holds_generator_state(saved)
    _, seeded, seeded_pt = _resumable()
    _train(seeded_pt, steps=2)
    assert _holds_generator_state(seeded.state_dict())  # the probe can see a generator state
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(pt.optimizer.state_dict())
    resumed = []
    for _ in range(2):
        m2, e2, pt2 = _resumable(engine=PrivacyEngine())
        m2.load_state_dict(saved_model)
        pt2.optimizer.load_state_dict(saved_opt)
        e2.load_state_dict(saved)
        _train(pt2, steps=1)
        assert e2.steps == 3
        resumed.append(torch.cat([p.detach().flatten() for p in m2.parameters()]))
    assert not torch.equal(resumed[0], resumed[1])


# ---------------------------------------------------------------------------------------------
# sampling and accounting


def test_accountant_sees_q_and_the_true_number_of_steps() -> None:
    data = _data(n=100)
    engine, pt = _private(data=data, batch_size=30, noise_multiplier=1.1)
    assert len(pt.data_loader) == 4  # ⌈100/30⌉ logical steps per epoch, but q = 0.3, not 1/4
    taken = _train(pt) + _train(pt, steps=2)
    assert taken == engine.steps == 6
    assert engine.accountant.ledger.events == (PoissonSampled(0.3, Gaussian(1.1)),) * 6
    assert engine.get_epsilon(1e-5) == dpsgd_epsilon(0.3, 1.1, 6, 1e-5)
    # Independent reference: dp-accounting's PLD accountant (its rounding differs slightly).
    from dp_accounting import dp_event, pld

    ref = pld.PLDAccountant()
    ref.compose(dp_event.PoissonSampledDpEvent(0.3, dp_event.GaussianDpEvent(1.1)), 6)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=0.02)


def test_empty_batches_train_and_are_accounted() -> None:
    model = _mlp()
    engine, (m, optimizer, loader) = _private(model, data=_data(n=20), batch_size=1, physical_batch_size=4)
    crit = nn.CrossEntropyLoss()
    empty_steps = 0
    for x, y in loader:
        before = [p.detach().clone() for p in m.parameters()]
        optimizer.zero_grad()
        crit(m(x), y).backward()
        optimizer.step()
        if len(x) == 0:
            empty_steps += 1
            assert not all(
                torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True)
            )  # noise still applied
    assert empty_steps >= 1  # P(empty) = 0.95^20 ≈ 0.36 per step; seeded run has several
    assert engine.steps == len(loader) == 20


def test_sigma_zero_is_never_called_private() -> None:
    engine, pt = _private(noise_multiplier=0.0)
    assert engine.get_epsilon(1e-5) == 0.0
    _train(pt, steps=1)
    assert engine.accountant.ledger.events == (NonPrivate(),)
    assert math.isinf(engine.get_epsilon(1e-5))


def test_calibration_to_a_target_epsilon() -> None:
    data = _data(n=200)
    engine, pt = _private(data=data, batch_size=20, target_epsilon=3.0, target_delta=1e-4, epochs=1)
    assert engine.noise_multiplier == calibrate_noise(3.0, 1e-4, 0.1, 10)
    assert _train(pt) == 10
    assert 2.9 < engine.get_epsilon(1e-4) <= 3.0


def test_shuffled_loader_needs_opt_in_and_is_not_amplified() -> None:
    with pytest.raises(SamplingError, match="allow_non_poisson"):
        _private(poisson_sampling=False)
    engine, pt = _private(poisson_sampling=False, allow_non_poisson=True, batch_size=16, noise_multiplier=2.0)
    assert engine.sampling == "shuffled_not_amplified"
    sizes = []
    for x, _ in pt.data_loader:
        sizes.append(len(x))
    assert sizes == [16, 16, 8]
    _train(pt)
    assert engine.accountant.ledger.events == (Gaussian(1.0),) * 3
    assert engine.get_epsilon(1e-5) > dpsgd_epsilon(0.4, 2.0, 3, 1e-5)


def test_privacy_settings_do_not_depend_on_performance_settings() -> None:
    outcomes = []
    for physical, dtype in [
        (None, torch.float64),
        (3, torch.float64),
        (None, torch.float32),
        (2, torch.float32),
    ]:
        engine, pt = _private(
            _mlp(dtype=dtype),
            data=_data(dtype=dtype),
            physical_batch_size=physical,
            engine=PrivacyEngine(seed=5, reproducible=True),
        )
        _train(pt, steps=4)
        outcomes.append((engine.plan, engine.accountant.ledger.to_json(), engine.get_epsilon(1e-5)))
    assert all(o == outcomes[0] for o in outcomes)


# ---------------------------------------------------------------------------------------------
# checkpoints


def _resumable(
    seed: int = 7, engine: PrivacyEngine | None = None
) -> tuple[nn.Module, PrivacyEngine, PrivateTraining]:
    model = _mlp(seed=3)
    engine, pt = _private(
        model,
        opt=lambda p: torch.optim.Adam(p, lr=0.01),
        engine=engine or PrivacyEngine(seed=seed, reproducible=True),
        batch_size=8,
        physical_batch_size=3,
    )
    return model, engine, pt


def test_state_dict_resumes_exactly() -> None:
    model, engine, pt = _resumable()
    assert _train(pt, steps=3) == 3  # mid-epoch (5 steps per epoch)
    saved = json.loads(json.dumps(engine.state_dict()))
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(pt.optimizer.state_dict())
    _train(pt, steps=4)  # crosses the epoch boundary
    expected = [p.detach().clone() for p in model.parameters()]

    model2, engine2, pt2 = _resumable(seed=999)  # different seed: the state must carry everything
    model2.load_state_dict(saved_model)
    pt2.optimizer.load_state_dict(saved_opt)
    engine2.load_state_dict(saved)
    assert engine2.steps == 3
    _train(pt2, steps=2)
    _train(pt2, steps=2)
    assert engine2.steps == engine.steps == 7
    for p, e in zip(model2.parameters(), expected, strict=True):
        assert torch.equal(p, e)
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_state_dict_refusals() -> None:
    with pytest.raises(CheckpointError):
        PrivacyEngine().state_dict()
    _, engine, (m, optimizer, loader) = _resumable()
    crit = nn.CrossEntropyLoss()
    for x, y in loader:  # stop after the first chunk of a multi-chunk logical batch
        optimizer.zero_grad()
        crit(m(x), y).backward()
        optimizer.step()
        if not loader.signal.last_chunk:
            break
    with pytest.raises(CheckpointError, match="pending"):
        engine.state_dict()
    other, _ = _private(noise_multiplier=2.0)
    with pytest.raises(CheckpointError, match="plan"):
        engine.load_state_dict(other.state_dict())


# ---------------------------------------------------------------------------------------------
# the user's optimizer keeps working


def test_wrapped_optimizer_works_with_schedulers_and_state() -> None:
    model = _mlp()
    _, pt = _private(model, opt=lambda p: torch.optim.SGD(p, lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(pt.optimizer, step_size=1, gamma=0.5)
    _train(pt, steps=1)
    scheduler.step()
    assert pt.optimizer.param_groups[0]["lr"] == 0.5
    state = pt.optimizer.state_dict()
    pt.optimizer.load_state_dict(state)
    assert pt.optimizer.param_groups is pt.optimizer.original_optimizer.param_groups
    with pytest.raises(ConfigError):
        pt.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_frozen_parameters_are_left_alone() -> None:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    _, pt = _private(model)
    _train(pt, steps=2)
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None


# ---------------------------------------------------------------------------------------------
# refusals: one veil error each, naming the fix, leaving the model untouched


class _MixesExamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0))


class _LooksAhead(nn.Module):
    """Example i sees example i + 1: invisible when only the first example is changed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(
            x + 0.1 * torch.roll(x, -1, dims=0) * (torch.arange(len(x)) < len(x) - 1).unsqueeze(1)
        )


class _UpdatesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3).double()
        self.register_buffer("ema", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter([])


def _case_batchnorm() -> None:
    _private(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double())


def _case_missing_param() -> None:
    model = _mlp()
    _private(model, opt=lambda p: torch.optim.SGD(list(p)[:2], lr=0.1))


def _case_extra_param() -> None:
    stranger = nn.Parameter(torch.zeros(2))
    _private(opt=lambda p: torch.optim.SGD([*list(p), stranger], lr=0.1))


def _case_batch_size_none() -> None:
    model = _mlp()
    loader = DataLoader(_data(), batch_sampler=[[0, 1], [2, 3]])
    PrivacyEngine(seed=0, reproducible=True).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip


def _case_iterable() -> None:
    model = _mlp()
    PrivacyEngine(seed=0, reproducible=True).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_Stream(), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip


def _case_twice() -> None:
    engine, _ = _private()
    _private(engine=engine)


BAD_INPUTS: dict[str, tuple[Callable[[], Any], type[VeilError]]] = {
    "batchnorm": (_case_batchnorm, ModelNotSupportedError),
    "forward mixes examples": (lambda: _private(_MixesExamples()), ModelNotSupportedError),
    "forward looks at the next example": (lambda: _private(_LooksAhead()), ModelNotSupportedError),
    "forward updates a buffer": (lambda: _private(_UpdatesBuffer()), ModelNotSupportedError),
    "criterion reduction none": (
        lambda: _private(criterion=nn.CrossEntropyLoss(reduction="none")),
        InvalidParameterError,
    ),
    "loss_reduction none": (lambda: _private(loss_reduction="none"), InvalidParameterError),
    "reduction mismatch": (
        lambda: _private(loss_reduction="mean", criterion=nn.CrossEntropyLoss(reduction="sum")),
        InvalidParameterError,
    ),
    "param missing from optimizer": (_case_missing_param, InvalidParameterError),
    "param not in model": (_case_extra_param, InvalidParameterError),
    "max_grad_norm 0": (lambda: _private(max_grad_norm=0.0), InvalidParameterError),
    "max_grad_norm negative": (lambda: _private(max_grad_norm=-1.0), InvalidParameterError),
    "max_grad_norm nan": (lambda: _private(max_grad_norm=float("nan")), InvalidParameterError),
    "non-poisson without opt-in": (lambda: _private(poisson_sampling=False), SamplingError),
    "no sigma, no target": (lambda: _private(noise_multiplier=None), InvalidParameterError),
    "sigma and target": (lambda: _private(noise_multiplier=1.0, target_epsilon=1.0), InvalidParameterError),
    "negative sigma": (lambda: _private(noise_multiplier=-1.0), InvalidParameterError),
    "delta >= 1/N": (
        lambda: _private(noise_multiplier=None, target_epsilon=1.0, target_delta=0.05, epochs=1),
        InvalidParameterError,
    ),
    "secure with seed": (lambda: PrivacyEngine(secure_rng=True, seed=1), InvalidParameterError),
    "physical batch 0": (lambda: _private(physical_batch_size=0), InvalidParameterError),
    "batch larger than data": (lambda: _private(batch_size=41), SamplingError),
    "loader without batch_size": (_case_batch_size_none, SamplingError),
    "iterable dataset": (_case_iterable, SamplingError),
    "make_private twice": (_case_twice, ConfigError),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_with_a_fix(case: str) -> None:
    fn, error = BAD_INPUTS[case]
    with pytest.raises(error) as info:
        fn()
    assert "Fix:" in str(info.value)


def test_refusal_lists_all_problems_and_leaves_the_model_untouched() -> None:
    model = nn.Sequential(
        nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)
    )
    model = model.double()
    with pytest.raises(ModelNotSupportedError) as info:
        _private(model)
    assert [p.location for p in info.value.problems] == ["1", "3"]
    assert _no_hooks(model)
    _, pt = _private(veil.fix(model))
    assert _train(pt, steps=1) == 1


def test_failed_make_private_leaves_engine_reusable() -> None:
    engine = PrivacyEngine(seed=0, reproducible=True)
    with pytest.raises(InvalidParameterError):
        _private(engine=engine, max_grad_norm=0.0)
    assert engine.plan is None
    _, pt = _private(engine=engine)
    assert _train(pt, steps=1) == 1
