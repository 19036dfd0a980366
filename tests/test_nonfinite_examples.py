"""An example whose gradient is not finite adds exactly zero: the per-record rule after the charge.

A NaN or an infinity in one record's input, or a loss term that overflows for it, must not turn
the step's clipped sum (and so the released model) into NaN: that would reveal the record, and
refusing the run on it would too. The clipper drops such an example from the weighted sums (its
operands replaced by zeros), on every rule's ghost and materialised path. Reference: the naive
per-example loop of tests/test_clipping.py over the other examples only (float64, 1e-9).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from test_clipping import (  # _float64: the same autouse float64 fixture
    MODELS,
    _float64,  # noqa: F401
    _output,
    assert_close,
    clip_and_sum,
    per_example_grads,
    run_clipper,
)
from veil.clipping import Ghost, LayerRule, PerSampleClipper, register_rule
from veil.clipping.registry import _REGISTRY
from veil.engine import PrivacyEngine
from veil.errors import ModelNotSupportedError


def _poison(kind: str, x: Tensor, target: Tensor, row: int) -> tuple[Tensor, Tensor]:
    x, target = x.clone(), target.clone()
    if kind == "target_inf":
        target[row] = math.inf
    elif kind == "target_nan":
        target[row].view(-1)[0] = math.nan
    elif kind == "input_inf":
        x[row].view(-1)[0] = math.inf
    else:
        x[row] = math.nan
    return x, target


@pytest.mark.parametrize("kind", ["target_inf", "input_nan"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_non_finite_example_adds_zero(name: str, kind: str) -> None:
    model, x = MODELS[name]()
    if kind.startswith("input") and not x.is_floating_point():
        pytest.skip("token ids cannot hold a NaN")
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    row = 1
    bad_x, bad_target = _poison(kind, x, target, row)
    good = [i for i in range(x.shape[0]) if i != row]
    grads = per_example_grads(model, x[good], target[good])
    _, norms = clip_and_sum(grads, [1.0])
    bound = float(norms.median())
    want, _ = clip_and_sum(grads, [bound])
    for reduction in ("mean", "sum"):
        _, got, got_norms = run_clipper(model, bad_x, bad_target, bound, reduction)
        assert not math.isfinite(float(got_norms[row]))
        assert all(bool(torch.isfinite(t).all()) for t in got)
        assert_close(got, want)


def test_finite_batches_take_the_unchanged_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No example dropped when every norm is finite: ``without`` is never called."""
    called: list[int] = []
    original = Ghost.__init__

    def spy(self: Ghost, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        inner = self.without
        if inner is not None:

            def without(keep: Tensor) -> object:
                called.append(1)
                return inner(keep)

            self.without = without  # type: ignore[assignment]

    monkeypatch.setattr(Ghost, "__init__", spy)
    model, x = MODELS["transformer_encoder_layer"]()
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    run_clipper(model, x, target, 1.0)
    assert called == []
    run_clipper(model, *_poison("target_nan", x, target, 0), 1.0)
    assert called


class Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def test_a_custom_ghost_without_drop_is_refused_whatever_the_data() -> None:
    """A user rule whose Ghost cannot drop an example is refused at its first step, on finite data
    too: whether the run stops must not depend on one record's values."""

    @register_rule(Doubled)
    class DoubledRule(LayerRule):
        param_names = ("weight",)

        def contributions(self, module, record, names, materialise):  # type: ignore[no-untyped-def]
            a, g = record.args[0], record.grads[0]
            per = a * g
            return {"weight": Ghost(per.square().sum(1), lambda c: c @ per)}

    try:
        x, target = torch.randn(5, 4), torch.randn(5, 4)
        with pytest.raises(ModelNotSupportedError, match="without"):
            run_clipper(Doubled(), x, target, 1.0)
    finally:
        _REGISTRY.pop(Doubled, None)


class Standardised(nn.Module):
    """Mixes examples through the batch's standard deviation, which is NaN for a batch of one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x @ self.w + (x - x.mean(0)) / x.std(0), x], dim=1)


def test_the_fallback_still_refuses_a_module_whose_example_alone_is_nan() -> None:
    """The determinism check compares where the batched output is finite and needs the example
    recomputed alone to be finite there: NaN alone but finite batched means the module mixes."""
    model = nn.Sequential(Standardised(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    with pytest.raises(ModelNotSupportedError, match="differs from the batched forward"):
        run_clipper(model, x, torch.randn(6, 1), 1.0, "sum")


def _one_epoch(x: Tensor, y: Tensor) -> list[Tensor]:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    engine = PrivacyEngine(seed=11, reproducible=True)
    m, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.5,
        max_grad_norm=1.0,
        loss_reduction="sum",
        poisson_sampling=False,
        allow_non_poisson=True,
    )
    crit = nn.CrossEntropyLoss(reduction="sum")
    for xb, yb in loader:
        optimizer.zero_grad()
        crit(m(xb), yb).backward()
        optimizer.step()
    return [p.detach().clone() for p in m.parameters()]


def test_training_with_a_nan_record_equals_training_without_it() -> None:
    """End to end through make_private (fixed batches in order, seeded noise): the model after an
    epoch with a NaN record last equals the model trained on the same data without it (its
    batch one row shorter, the same noise). Without the rule every parameter is NaN."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
    poisoned = x.clone()
    poisoned[31, 2] = math.nan
    got = _one_epoch(poisoned, y)
    want = _one_epoch(x[:31], y[:31])
    assert all(bool(torch.isfinite(t).all()) for t in got)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_clipper_api_is_unchanged_for_finite_batches() -> None:
    model = nn.Linear(3, 2)
    clipper = PerSampleClipper(model, 1.0)
    try:
        (model(torch.randn(4, 3)).sum()).backward()
        norms = clipper.accumulate()
        assert bool(torch.isfinite(norms).all())
    finally:
        clipper.remove()


def test_the_clipper_counts_the_examples_it_dropped() -> None:
    model, x = MODELS["mlp"]()
    with torch.no_grad():
        target = torch.randn_like(_output(model(x)))
    bad_x, bad_target = _poison("input_nan", x, target, 2)
    bad_x[4, 0] = math.inf
    clipper = PerSampleClipper(model, 1.0)
    try:
        for inputs in (x, bad_x):
            (model(inputs) - bad_target).square().sum().backward()
            clipper.accumulate()
        assert clipper.dropped_not_finite == 2
    finally:
        clipper.remove()
