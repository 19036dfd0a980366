"""Canaries: the injected gradient is exactly what the audit claims, and the one-run audit detects
leakage (σ = 0, a broken engine) without ever exceeding a correct engine's ε.

The pipeline tests run veil's real training (digits with the default model — random Fourier
features computed once and a linear head — and its tuned preset: 60 steps) with 150 white-box
Dirac canaries on the head; each takes a second or two.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from scipy.stats import binom
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import veil
from veil.audit.canaries import GradientCanaries
from veil.audit.coordinates import (
    AUTO_CANARIES,
    auto_canary_count,
    coordinate_activity,
    hook_free_copy,
    quiet_coordinates,
)
from veil.audit.input_canaries import InputCanaries
from veil.audit.run import AuditSettings, audit, run_one_run_audit
from veil.errors import InvalidParameterError
from veil.mechanisms.rng import SeededSource
from veil.optimizer import DPOptimizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    # Tiny models: intra-op threads only add synchronisation cost on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(
    seed: int = 0, n: int = 40, batch: int = 10, sigma: float = 0.7, canaries: GradientCanaries | None = None
):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen)
    y = torch.randint(0, 3, (n,), generator=gen)
    engine = veil.PrivacyEngine(seed=seed, reproducible=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, dp_opt, dp_loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(),
    )
    return model, dp_opt, dp_loader, engine


def _one_step(model: nn.Module, opt: DPOptimizer, loader: DataLoader) -> list[torch.Tensor]:
    xb, yb = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("direction", ["dirac", "random"])
def test_injected_gradient_is_the_included_canaries_over_b(direction: str) -> None:
    # Two runs with the same engine seed (same sampling, same noise): the released gradients differ
    # by exactly Σ_{drawn} c_i / B, and every canary vector has norm exactly C (a valid record).
    model_a, opt_a, loader_a, engine_a = _tiny(batch=40)  # q = 1: every included canary is drawn
    model_b, opt_b, loader_b, _ = _tiny(batch=40)
    canaries = GradientCanaries.design(
        model_a,
        8,
        rng=SeededSource(3),
        max_grad_norm=1.0,
        direction=direction,  # type: ignore[arg-type]
    )
    canaries.attach(opt_a, sampling_rate=engine_a.sampling_rate)
    grads_a = _one_step(model_a, opt_a, loader_a)
    grads_b = _one_step(model_b, opt_b, loader_b)
    vectors = canaries.vectors()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)
    assert canaries.included.any() and (canaries.last_drawn == canaries.included).all()
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(grads_a, grads_b, strict=True)]).double().numpy()
    expected = vectors[canaries.last_drawn].sum(axis=0) / 40
    np.testing.assert_allclose(diff, expected, atol=1e-6)


@pytest.mark.parametrize("direction", ["dirac", "random"])
def test_without_noise_each_score_is_exactly_its_inclusions(direction: str) -> None:
    # The auditor subtracts the real records' clipped sum, so at σ = 0 a score carries no data drift:
    # 1 per inclusion of its canary (up to the other canaries' overlap for random directions).
    model, opt, loader, engine = _tiny(n=40, batch=10, sigma=0.0)
    canaries = GradientCanaries.design(
        model,
        8,
        rng=SeededSource(7),
        max_grad_norm=1.0,
        direction=direction,  # type: ignore[arg-type]
    )
    canaries.attach(opt, sampling_rate=engine.sampling_rate)
    for _ in range(6):
        _one_step(model, opt, loader)
    vectors = canaries.vectors()
    overlap = vectors @ vectors.T  # identity for Dirac canaries
    np.testing.assert_allclose(canaries.sum_scores, overlap @ canaries.inclusions, atol=1e-5)
    if direction == "dirac":
        np.testing.assert_allclose(canaries.sum_scores, canaries.inclusions, atol=1e-6)


def test_canaries_join_steps_with_the_sampling_rate() -> None:
    # Included canaries join each step independently with probability q; excluded ones never.
    # Total joins ~ Binomial(included · steps, q); the 4.5-sd band fails a correct sampler with
    # probability < 1e-5 (false-failure rate).
    model, opt, loader, engine = _tiny(n=40, batch=10, sigma=0.0)
    canaries = GradientCanaries.design(model, 12, rng=SeededSource(5), max_grad_norm=1.0)
    canaries.attach(opt, sampling_rate=engine.sampling_rate)
    for _ in range(15):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    q, steps = engine.sampling_rate, canaries.steps
    assert steps == engine.steps == 60
    assert canaries.inclusions[~canaries.included].sum() == 0
    n = int(canaries.included.sum()) * steps
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert abs(canaries.inclusions.sum() - mean) <= 4.5 * sd
    assert binom.sf(canaries.inclusions.max() - 1, steps, q) > 1e-6  # no canary is drawn absurdly often


def test_quiet_coordinates_avoid_active_inputs_and_leave_the_model_alone() -> None:
    # A logistic regression on inputs whose last two features are always 0: the weights of those
    # features get no data gradient, so they are the quietest coordinates. The measurement (vmap or
    # the per-example loop) matches a plain per-example autograd loop.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 2))
    x = np.random.default_rng(0).standard_normal((50, 5)).astype(np.float32)
    x[:, 3:] = 0
    y = (x[:, 0] > 0).astype(np.int64)
    before = copy.deepcopy(model.state_dict())
    activity = coordinate_activity(model, x, y, max_grad_norm=0.5, rng=SeededSource(0))
    reference = np.zeros(12)
    for i in range(50):  # 50 ≤ the 64-example sample: every example is used
        model.zero_grad()
        nn.functional.cross_entropy(
            model(torch.from_numpy(x[i : i + 1])), torch.from_numpy(y[i : i + 1])
        ).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
        reference += np.abs(g) * min(1.0, 0.5 / np.linalg.norm(g)) / 50
    model.zero_grad()
    np.testing.assert_allclose(activity, reference, rtol=1e-5, atol=1e-9)
    coords = quiet_coordinates(activity, 4, rng=SeededSource(0))
    assert set(coords.tolist()) == {r * 5 + c for r in range(2) for c in (3, 4)}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    twin = hook_free_copy(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in twin.modules())
    # The automatic count: every coordinate the model has, up to AUTO_CANARIES (data drift is
    # subtracted from the scores, so active coordinates serve as well as quiet ones).
    assert (
        auto_canary_count(activity, expected_batch_size=10, max_grad_norm=0.5, noise_multiplier=0, limit=12)
        == 12
    )
    assert auto_canary_count(np.r_[np.zeros(60), np.ones(40)], expected_batch_size=10, max_grad_norm=1,
                             noise_multiplier=0, limit=100) == 100  # fmt: skip
    assert auto_canary_count(np.zeros(10**5), expected_batch_size=10, max_grad_norm=1,
                             noise_multiplier=1, limit=10**5) == AUTO_CANARIES  # fmt: skip


def test_too_many_canaries_are_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 3))  # 15 parameters
    with pytest.raises(InvalidParameterError, match="canaries"):
        GradientCanaries.design(model, 16, rng=SeededSource(0), max_grad_norm=1.0)
    x = np.zeros((20, 4), np.float32)
    y = np.zeros(20, np.int64)
    with pytest.raises(InvalidParameterError, match="≤ 10"):
        InputCanaries.design(x, y, 11, 3, rng=SeededSource(0))
    with pytest.raises(InvalidParameterError, match="confidence"):
        AuditSettings(confidence=1.0)


def test_input_canaries_carry_a_wrong_label() -> None:
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20) % 4
    c = InputCanaries.design(x, y, 10, 4, rng=SeededSource(1))
    assert (c.y != y[c.source]).all() and ((c.y >= 0) & (c.y < 4)).all()
    np.testing.assert_array_equal(c.x, x[c.source])
    assert len(set(c.source.tolist())) == 10
    np.testing.assert_array_equal(c.weights(), c.included.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# The audit on real training runs (digits)
# ---------------------------------------------------------------------------------------------
CANARY = {"attack": "canary", "canaries": 150}


def test_non_private_run_leaks_at_least_one() -> None:
    report = audit({"dataset": "digits", "seed": 0}, AuditSettings(**CANARY, non_private=True), write=False)
    assert report.epsilon_theoretical is None and report.verdict == "no_promise"
    assert report.epsilon_lower_bound is not None and report.epsilon_lower_bound >= 1.0
    assert report.canaries is not None and report.canaries["gradient"]["score"] == "sum"


def test_private_run_at_epsilon_two_stays_below_two() -> None:
    # A correct engine exceeds its ε here with probability ≤ 5% over the seed (the theorem); the
    # seed is fixed, so this is deterministic. The broken engine below shows the audit has power.
    report = audit({"dataset": "digits", "seed": 0, "epsilon": 2.0}, AuditSettings(**CANARY), write=False)
    assert report.epsilon_theoretical == pytest.approx(2.0, abs=1e-3)
    assert report.epsilon_theoretical <= 2.0 + 1e-9
    assert report.epsilon_lower_bound is not None and report.epsilon_lower_bound <= 2.0
    assert report.verdict == "consistent"
    assert report.canaries is not None and report.canaries["gradient"]["score"] == "likelihood"


def test_broken_engine_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tramèr et al. 2022: noise std divided by the batch size. Built here only, by patching the
    # DP optimizer's noise std; the accountant still promises ε = 1.
    broken = property(
        lambda self: self.noise_multiplier * float(self.clipper.sensitivity) / self.expected_batch_size
    )
    monkeypatch.setattr(DPOptimizer, "noise_std", broken)
    report = audit({"dataset": "digits", "seed": 0, "epsilon": 1.0}, AuditSettings(**CANARY), write=False)
    assert report.epsilon_theoretical is not None and report.epsilon_theoretical <= 1.0 + 1e-9
    assert report.epsilon_lower_bound is not None and report.epsilon_lower_bound > report.epsilon_theoretical
    assert report.verdict == "violation" and "ALERT" in report.reading


def test_noise_ten_times_too_small_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # A subtler bug than the one above: noise std σC/10 while the accountant promises ε = 2 for σC.
    # The bound exceeds the promise (the correct engine at ε = 2 stays below it, test above).
    monkeypatch.setattr(
        DPOptimizer,
        "noise_std",
        property(lambda self: self.noise_multiplier * float(self.clipper.sensitivity) / 10),
    )
    report = audit({"dataset": "digits", "seed": 0, "epsilon": 2.0}, AuditSettings(**CANARY), write=False)
    assert report.epsilon_theoretical is not None and report.epsilon_theoretical <= 2.0 + 1e-9
    assert report.epsilon_lower_bound is not None and report.epsilon_lower_bound > report.epsilon_theoretical
    assert report.verdict == "violation"


def test_one_run_audit_hook_for_veil_train() -> None:
    # What `veil train --audit` calls: attach after make_private, train, finish.
    from veil.data import load_dataset

    data = load_dataset("digits", seed=0)
    x = torch.from_numpy(data.x_train) / 16
    y = torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    engine = veil.PrivacyEngine(seed=0, reproducible=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.5, momentum=0.9)
    model, dp_opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=256),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(),
    )
    hook = run_one_run_audit(model, dp_opt, engine, (x[:64].numpy(), y[:64].numpy()), canaries=150, seed=0)
    for _ in range(8):
        for xb, yb in loader:
            dp_opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            dp_opt.step()
    section = hook.finish(delta=1e-5, epsilon_theoretical=engine.get_epsilon(1e-5))
    assert section["epsilon_theoretical"] is None and section["verdict"] == "no_promise"
    assert section["epsilon_lower_bound"] >= 1.0
    assert section["canaries"]["gradient"]["count"] == 150


def test_both_canary_kinds_share_the_confidence() -> None:
    # Two bounds reported jointly: each is computed at 1 − β/2, so their maximum holds at 1 − β.
    # Secure mode: noise, sampling and canary bits from the OS CSPRNG (nothing to seed).
    settings = AuditSettings(attack="canary", canary_kind="both", canaries=60)
    report = audit({"dataset": "digits", "epsilon": 4.0, "secure_rng": True}, settings, write=False)
    assert report.canaries is not None and report.canaries["count"] == 120
    grad, inp = report.canaries["gradient"], report.canaries["input"]
    assert grad["bound"]["confidence"] == pytest.approx(0.975) == inp["bound"]["confidence"]
    assert report.epsilon_lower_bound == max(grad["bound"]["epsilon"], inp["bound"]["epsilon"])
    assert report.confidence == 0.95 and report.run["records_in_training_set"] == report.run["n_train"] + 60
    from veil.data import load_dataset

    held_out = load_dataset("digits", seed=0).n_test
    assert report.mia is not None and report.mia["nonmembers"] == held_out - 60  # canaries left out
