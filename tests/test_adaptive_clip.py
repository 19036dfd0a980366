"""Adaptive clipping: the clip converges to the target quantile; the combined step costs exactly σ."""

from __future__ import annotations

import numpy as np
import pytest

from veil.accounting.calibrate import dpsgd_event, epsilon_of
from veil.accounting.events import SelfComposed
from veil.clipping.adaptive import AdaptiveClip, gradient_noise, step_event
from veil.errors import InvalidParameterError


@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.8])
def test_clip_converges_to_the_target_quantile(quantile: float) -> None:
    """Log-normal synthetic norms, Poisson batches of ~256, count noise B/20 (seeded: deterministic)."""
    rng = np.random.default_rng(7)
    population = rng.lognormal(mean=0.5, sigma=0.8, size=20000)
    state = AdaptiveClip(clip=0.05, target_quantile=quantile, count_std=256 / 20, expected_batch_size=256)
    history = []
    for _ in range(600):
        batch = population[rng.random(population.size) < 256 / population.size]
        state.update(batch, rng.normal(0, state.count_std))
        history.append(state.clip)
    reached = np.mean(population <= np.median(history[-200:]))
    assert abs(reached - quantile) < 0.03


def test_gradient_and_count_together_cost_the_planned_sigma() -> None:
    sigma, count_std, q = 1.2, 12.8, 0.05
    sg = gradient_noise(sigma, count_std)
    assert sg > sigma
    event = step_event(q, sg, count_std)
    assert event.event.noise_multiplier == pytest.approx(sigma, rel=1e-12)  # type: ignore[attr-defined]
    eps_adaptive = epsilon_of([SelfComposed(event, 500)], 1e-5, "rdp")
    eps_fixed = epsilon_of([SelfComposed(dpsgd_event(q, sigma), 500)], 1e-5, "rdp")
    assert eps_adaptive == pytest.approx(eps_fixed, rel=1e-9)
    # Without sampling the joint release is a plain Gaussian: RDP α/2σ_g² + α/2(2σ_b)² = α/2σ².
    assert step_event(1.0, sg, count_std).noise_multiplier == pytest.approx(sigma, rel=1e-12)  # type: ignore[attr-defined]


def test_too_little_count_noise_is_refused() -> None:
    with pytest.raises(InvalidParameterError):
        gradient_noise(2.0, 0.9)
    with pytest.raises(InvalidParameterError):
        AdaptiveClip(clip=1.0, target_quantile=1.0, count_std=10, expected_batch_size=100)


def test_engine_run_moves_the_clip_and_charges_the_planned_event() -> None:
    """A seeded engine run: C moves towards the median norm; the accountant's events are the planned
    σ steps (the count is inside them), while the gradient noise is the raised σ_g."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from veil import PrivacyEngine
    from veil.clipping.adaptive import enable_adaptive_clipping

    torch.manual_seed(0)
    x, y = torch.randn(2000, 10), torch.randint(0, 3, (2000,))
    model = torch.nn.Linear(10, 3)
    engine = PrivacyEngine(accountant="rdp", seed=1, reproducible=True)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=200),
        noise_multiplier=1.0,
        max_grad_norm=50.0,
        criterion=torch.nn.CrossEntropyLoss(),
    )
    hook = enable_adaptive_clipping(opt, target_quantile=0.5)
    assert opt.noise_multiplier == pytest.approx(gradient_noise(1.0, 10.0))
    for _ in range(3):
        for xb, yb in loader:
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    assert len(hook.history) == 30 and hook.state.clip < 10.0  # from 50 towards the median (~1-2)
    assert engine.plan is not None and engine.plan.event == dpsgd_event(0.1, 1.0)
    expected = epsilon_of([SelfComposed(dpsgd_event(0.1, 1.0), 30)], 1e-5, "rdp")
    assert engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-6)


def test_train_clip_adaptive_records_its_cost_in_the_ledger(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from veil.accounting.ledger import Ledger
    from veil.cli.main import main

    out = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--model", "logreg", "--epochs", "1", "--batch-size", "256"]
    code = main(
        [
            *args,
            "--clip",
            "adaptive",
            "--target-quantile",
            "0.5",
            "--no-baseline",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    ledger = Ledger.open(out / "ledger.jsonl")
    (record,) = list(ledger.of_kind("adaptive_clip"))
    sigma = ledger.header["noise_multiplier"]
    assert record["step_noise_multiplier"] == sigma
    assert record["gradient_noise_multiplier"] == pytest.approx(
        gradient_noise(sigma, record["count_noise_std"])
    )
    steps = list(ledger.of_kind("step"))
    assert steps and all(
        s["event"] == dpsgd_event(ledger.header["sampling_rate"], sigma).to_dict() for s in steps
    )
    report = json.loads((out / "report.json").read_text())
    assert report["epsilon_spent"] <= report["target_epsilon"]
    assert (
        main([*args, "--clip", "adaptive", "--target-quantile", "1.5", "--out", str(tmp_path / "bad")]) == 2
    )
    assert not (tmp_path / "bad").exists()
    # σ above twice the count noise (B/20 = 12.8): the count cannot fit in the step; refused up front.
    loud = [*args, "--clip", "adaptive", "--noise-multiplier", "30", "--out", str(tmp_path / "loud")]
    assert main(loud) == 2 and not (tmp_path / "loud").exists()
