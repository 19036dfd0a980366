"""A loss written in the training loop must not widen the sensitivity (veil.per_example_loss).

The engine watches every loss module applied to the private model's output, however deep: ops on
the way that mix examples (a softmax or mean over the batch, a row selection), a weighted mean, a
reduction other than the declared one or an unreduced loss reduced in the loop are refused when the
loss is computed; a factor applied to the loss before ``backward()`` (a batch-dependent one such as
``len(batch) / B``) is refused at ``step()``. Each refusal comes before any noisy update is released:
the engine has charged no step and the parameters have not moved. Both the ``make_private`` path and
the Opacus-style one (``make_private_with_epsilon``, the criterion returned by ghost mode) are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil import PrivacyEngine
from veil.errors import InvalidParameterError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WEIGHT = torch.tensor([1.0, 5.0, 0.2])


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(60, 5, generator=g), torch.randint(0, 3, (60,), generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=12)


def _make_private(path: str) -> tuple[PrivacyEngine, nn.Module, torch.optim.Optimizer, DataLoader]:
    engine = PrivacyEngine()
    model, optimizer, loader = _setup()
    if path == "make_private":
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
    elif path == "opacus_epsilon":  # the Opacus tutorial's call, the criterion kept in the loop
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            epochs=1,
            target_epsilon=3.0,
            target_delta=1e-3,
            max_grad_norm=1.0,
        )
    else:  # Opacus ghost mode: the engine hands back the criterion the loop uses
        model, optimizer, _criterion, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            criterion=nn.CrossEntropyLoss(),
            grad_sample_mode="ghost",
        )
    return engine, model, optimizer, loader


def _weighted_mean_module(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(weight=WEIGHT)(out, y)


def _weighted_mean_by_hand(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    terms = nn.CrossEntropyLoss(reduction="none")(out, y) * WEIGHT[y]
    return terms.sum() / WEIGHT[y].sum()


def _batch_factor(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out, y) * len(y) / 12.5  # 12.5: never 1, whatever the Poisson batch size


def _divided_by_batch_weight(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(reduction="sum")(out, y) / WEIGHT[y].sum()


def _sum_under_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss(reduction="sum")(out, y)


def _no_ops(out: torch.Tensor, steps: int = 6) -> torch.Tensor:
    """``steps`` autograd steps that leave the values alone (the review's depth bypass used 4)."""
    for _ in range(steps):
        out = (out + 0) * 1
    return out


def _factor_after_a_deep_path(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(_no_ops(out), y) * len(y) / 12.5


def _softmax_over_the_batch(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(torch.log_softmax(out, dim=0), y)


def _batch_centred_logits(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out - out.mean(0, keepdim=True), y)


def _mixing_after_a_deep_path(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.NLLLoss()(torch.log_softmax(_no_ops(out, 12), dim=-2), y)


def _mixing_passed_by_keyword(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(input=out - out.mean(0), target=y)


def _masked_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    keep = y != 2  # the mean's divisor would be the batch's number of kept rows
    return nn.CrossEntropyLoss()(out[keep], y[keep])


def _loss_of_the_batch_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out.mean(0, keepdim=True), y[:1])


def _similarity_to_the_batch(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out @ out.t(), torch.arange(len(y)))


PATHS = ["make_private", "opacus_epsilon", "opacus_ghost"]
WIDENING: list[Loss] = [
    _weighted_mean_module,
    _weighted_mean_by_hand,
    _batch_factor,
    _divided_by_batch_weight,
    _sum_under_mean,
    _factor_after_a_deep_path,
    _softmax_over_the_batch,
    _batch_centred_logits,
    _mixing_after_a_deep_path,
    _mixing_passed_by_keyword,
    _masked_mean,
    _loss_of_the_batch_mean,
    _similarity_to_the_batch,
]


@pytest.mark.parametrize("loss", WIDENING, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("path", PATHS)
def test_a_loss_that_widens_sensitivity_is_refused_before_any_release(path: str, loss: Loss) -> None:
    engine, model, optimizer, loader = _make_private(path)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidParameterError, match="loss") as info:
        for x, y in loader:
            optimizer.zero_grad()
            loss(model(x), y).backward()
            optimizer.step()
    assert "Fix:" in str(info.value)
    assert engine.steps == 0  # nothing charged, so nothing was released
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out, y)


def _functional_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _nll_on_log_softmax(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.NLLLoss()(torch.log_softmax(out, dim=1), y)


def _temperature(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out / 2.0, y)


def _rows_viewed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.CrossEntropyLoss()(out.view(len(out), -1), y)


def _deep_row_wise_path(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = nn.functional.normalize(_no_ops(out, 12), dim=-1).clamp(min=-10) * 3.0
    return nn.NLLLoss()(torch.log_softmax(logits.unsqueeze(1), dim=-1).squeeze(1), y)


ROW_WISE: list[Loss] = [_mean, _nll_on_log_softmax, _temperature, _rows_viewed, _deep_row_wise_path]


@pytest.mark.parametrize("loss", [_functional_mean, *ROW_WISE], ids=lambda f: f.__name__)
@pytest.mark.parametrize("path", PATHS)
def test_an_ordinary_mean_loss_trains(path: str, loss: Loss) -> None:
    engine, model, optimizer, loader = _make_private(path)
    for x, y in loader:
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
    assert engine.steps == len(loader) == 5
    if loss is not _functional_mean:  # a loss module was found however deep, and checked
        assert cast(Any, optimizer).loss_guard.checked == 5


def test_an_ordinary_sum_loss_trains_under_a_sum_reduction() -> None:
    engine = PrivacyEngine()
    model, optimizer, loader = _setup()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=criterion,
    )
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 5


def test_a_loss_on_other_tensors_is_left_alone() -> None:
    """Loss modules that never see the private model's output (a probe, another network) pass."""
    engine, model, optimizer, loader = _make_private("make_private")
    for x, y in loader:
        optimizer.zero_grad()
        nn.CrossEntropyLoss(weight=WEIGHT)(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
        nn.CrossEntropyLoss()(model(x), y).backward()
        optimizer.step()
    assert engine.steps == 5


def test_the_guard_keeps_no_graph_and_no_global_hook_alive() -> None:
    import gc

    from torch.nn.modules import module as torch_module

    gc.collect()  # earlier tests' optimizers (and their guards' hooks) are gone before counting
    hooks_before = len(torch_module._global_forward_hooks)
    engine, model, optimizer, loader = _make_private("make_private")
    assert len(torch_module._global_forward_hooks) == hooks_before + 1
    x = torch.randn(4, 5)
    for _ in range(40):  # forwards without a step (evaluation with grad enabled)
        model(x)
    assert len(cast(Any, optimizer).loss_guard._outputs) <= 16
    del engine, model, optimizer, loader
    gc.collect()
    assert len(torch_module._global_forward_hooks) == hooks_before


class _TupleModel(nn.Module):
    """Returns ``(logits, hidden)``, or a dict of them, as Hugging Face-style models do."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.body, self.head, self.as_dict = nn.Linear(5, 4), nn.Linear(4, 3), as_dict

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.tanh(self.body(x))
        logits = self.head(hidden)
        return {"logits": logits, "hidden": hidden} if self.as_dict else (logits, hidden)


def _train(
    model: nn.Module, loss: Callable[[Any, torch.Tensor], torch.Tensor], float_targets: bool = False
) -> int:
    engine = PrivacyEngine()
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (60,), generator=g)
    data = TensorDataset(torch.randn(60, 5, generator=g), y.float().clamp(max=1) if float_targets else y)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=12),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for xb, yb in loader:
        optimizer.zero_grad()
        loss(model(xb), yb).backward()
        optimizer.step()
    assert cast(Any, optimizer).loss_guard.checked == engine.steps
    return engine.steps


def test_common_idioms_on_other_outputs_train() -> None:
    """BCE on a squeezed single logit, a tuple or dict output, per-token logits flattened."""
    torch.manual_seed(0)
    bce = nn.BCEWithLogitsLoss()
    assert _train(nn.Linear(5, 1), lambda out, y: bce(out.squeeze(-1), y), float_targets=True) == 5
    ce = nn.CrossEntropyLoss()
    assert _train(_TupleModel(as_dict=False), lambda out, y: ce(out[0], y)) == 5
    assert _train(_TupleModel(as_dict=True), lambda out, y: ce(torch.log_softmax(out["logits"], -1), y)) == 5
    tokens = nn.Sequential(nn.Linear(5, 12), nn.Unflatten(1, (4, 3)))  # [B, T=4, V=3] per-token logits
    per_token = lambda out, y: ce(out.reshape(-1, 3), y.repeat_interleave(4))  # noqa: E731
    assert _train(tokens, per_token) == 5
    with pytest.raises(InvalidParameterError, match="batch dimension"):  # each output is watched
        _train(_TupleModel(as_dict=True), lambda out, y: ce(out["hidden"] - out["hidden"].mean(0), y))


# Losses inputs the guard is asked about, from a [4, 6] model output (independent-reference test).
_RECIPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda o: o,
    "log_softmax(-1)": lambda o: torch.log_softmax(o, -1),
    "log_softmax(0)": lambda o: torch.log_softmax(o, 0),
    "softmax(-2)": lambda o: torch.softmax(o, -2),
    "centred": lambda o: o - o.mean(0),
    "row-centred": lambda o: o - o.mean(1, keepdim=True),
    "max(0)": lambda o: o - o.max(0).values,
    "amax(1)": lambda o: o - o.amax(1, keepdim=True),
    "cumsum(0)": lambda o: o.cumsum(0),
    "sort(0)": lambda o: o.sort(0).values,
    "normalize(-1)": lambda o: nn.functional.normalize(o, dim=-1),
    "normalize(0)": lambda o: nn.functional.normalize(o, dim=0),
    "layer_norm(rows)": lambda o: nn.functional.layer_norm(o, (6,)),
    "layer_norm(all)": lambda o: nn.functional.layer_norm(o, (4, 6)),
    "view(B, -1)": lambda o: o.view(len(o), -1),
    "view(2, -1)": lambda o: o.view(2, -1),
    "flatten then rows": lambda o: o.reshape(-1).view(len(o), 6),
    "flatten then pairs": lambda o: o.reshape(-1).view(-1, 3),
    "flatten then split": lambda o: o.reshape(-1).view(3, -1),
    "transpose": lambda o: o.t(),
    "unsqueeze(0)": lambda o: o.unsqueeze(0),
    "unsqueeze(1)": lambda o: o.unsqueeze(1),
    "stack(0)": lambda o: torch.stack([o, o], 0),
    "stack(1)": lambda o: torch.stack([o, 2 * o], 1),
    "cat(1)": lambda o: torch.cat([o, torch.ones(len(o), 1)], 1),
    "select column": lambda o: o[:, 2],
    "columns": lambda o: o[:, [0, 2]],
    "gather": lambda o: o.gather(1, torch.tensor([[0], [1], [2], [3]])),
    "similarity": lambda o: o @ o.t(),
    "projection": lambda o: o @ torch.linspace(-1, 1, 12, dtype=o.dtype).view(6, 2),
    "row of one broadcast": lambda o: o + o.sum(1, keepdim=True).t()[:, :1].t(),
    "batch mean row": lambda o: o.mean(0, keepdim=True),
    "batch mean, as many classes as rows": lambda o: o[:, :4].mean(0),
    "row sums broadcast as a row": lambda o: o[:, :4] + o.sum(1),
    "deep row-wise": lambda o: torch.tanh(_no_ops(o, 10)).exp().log1p() / 3.0,
    "deep then batch mean": lambda o: _no_ops(o, 10) - _no_ops(o, 10).mean(0),
}


def _mixes_rows(out: torch.Tensor, recipe: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Reference: does some row (dim 0) of the loss input have a non-zero derivative in two
    examples' rows of the model output? From the full Jacobian, not from the graph."""
    jacobian = torch.autograd.functional.jacobian(recipe, out.detach().double())
    loss_input = recipe(out.detach().double())
    rows = loss_input.shape[0] if loss_input.dim() else 1
    per_row = jacobian.reshape(rows, -1, *out.shape).abs().sum(dim=(1, 3))  # [rows, examples]
    return bool(((per_row > 0).sum(1) > 1).any())


@pytest.mark.parametrize("name", list(_RECIPES))
def test_the_guard_accepts_only_paths_that_keep_rows_apart(name: str) -> None:
    """Soundness against the Jacobian: whatever the guard accepts keeps each loss row within one
    example; the mixing recipes (the review's included) are found."""
    from veil.loss_path import trace_to_outputs

    torch.manual_seed(0)
    out = nn.Linear(5, 6)(torch.randn(4, 5))
    verdict = trace_to_outputs(_RECIPES[name](out), {(id(out.grad_fn), out.output_nr): tuple(out.shape)})
    assert verdict.derived
    mixes = _mixes_rows(out, _RECIPES[name])
    if verdict.problem is None:
        assert not mixes, f"{name} mixes examples but the guard accepted it"
    expected_refused = {"log_softmax(0)", "softmax(-2)", "centred", "max(0)", "cumsum(0)", "sort(0)"}
    expected_refused |= {"normalize(0)", "layer_norm(all)", "view(2, -1)", "flatten then split"}
    expected_refused |= {"transpose", "unsqueeze(0)", "stack(0)", "similarity", "row of one broadcast"}
    expected_refused |= {"deep then batch mean", "batch mean row", "row sums broadcast as a row"}
    expected_refused |= {"batch mean, as many classes as rows"}
    assert (verdict.problem is not None) == (name in expected_refused), verdict.problem


def test_a_batch_of_one_example_is_never_refused_for_its_path() -> None:
    from veil.loss_path import trace_to_outputs

    out = nn.Linear(5, 6)(torch.randn(1, 5))
    sources = {(id(out.grad_fn), out.output_nr): tuple(out.shape)}
    assert trace_to_outputs(torch.log_softmax(out, 0) - out.mean(0), sources) == (True, None)
    assert trace_to_outputs(torch.randn(3, requires_grad=True) * 2, sources) == (False, None)
