"""validate() lists every problem at once; fix() repairs BatchNorm and running statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import veil
import veil.clipping
from veil.errors import Problem
from veil.validation import _group_count, fix, validate


class _Custom(nn.Module):
    """Owns a parameter; declared unsupported by a patched ``supports`` below."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _Ema(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _bad_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 48, 3),
        nn.BatchNorm2d(48),
        nn.InstanceNorm2d(48, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.LazyLinear(4),
        _Custom(),
        _Ema(),
    )


@pytest.fixture
def custom_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = veil.clipping.supports
    monkeypatch.setattr(veil.clipping, "supports", lambda m: not isinstance(m, _Custom) and real(m))


def test_validate_lists_every_problem(custom_unsupported: None) -> None:
    problems = validate(_bad_model())
    locations = [p.location for p in problems]
    assert locations == ["1", "2", "5", "6"]
    assert all(isinstance(p, Problem) and p.fix for p in problems)
    assert "BatchNorm2d" in problems[0].reason and "GroupNorm" in problems[0].fix
    assert "running" in problems[1].reason
    assert "clipping rule" in problems[2].reason
    assert "running_mean" in problems[3].reason


def test_clean_model_has_no_problems() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.GroupNorm(2, 8), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2)
    )
    assert validate(model) == []


def test_frozen_parameters_need_no_rule(custom_unsupported: None) -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Custom())
    model[1].w.requires_grad_(False)
    assert validate(model) == []


def test_fix_replaces_batchnorm_and_running_stats_and_leaves_input_alone() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.InstanceNorm2d(48, affine=True, track_running_stats=True)
    )
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
        model[2].weight.uniform_(0.5, 1.5)
    fixed = fix(model)
    assert isinstance(model[1], nn.BatchNorm2d)  # input untouched
    gn = fixed[1]
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 24 and gn.num_channels == 48
    assert gn.eps == model[1].eps
    assert torch.equal(gn.weight, model[1].weight) and torch.equal(gn.bias, model[1].bias)
    inorm = fixed[2]
    assert isinstance(inorm, nn.InstanceNorm2d) and not inorm.track_running_stats
    assert torch.equal(inorm.weight, model[2].weight)
    assert validate(fixed) == []
    fixed(torch.randn(2, 3, 8, 8))  # still runs


def test_fix_root_batchnorm_and_1d_inputs() -> None:
    fixed = fix(nn.BatchNorm1d(6, affine=False))
    assert isinstance(fixed, nn.GroupNorm) and fixed.num_groups == 6 and not fixed.affine
    assert fixed(torch.randn(5, 6)).shape == (5, 6)


def test_fixed_model_does_not_mix_examples() -> None:
    fixed = fix(nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8)))
    x = torch.randn(4, 3)
    y = x.clone()
    y[0] += 10
    assert torch.allclose(fixed(x)[1:], fixed(y)[1:])


@pytest.mark.parametrize(
    ("channels", "groups"), [(1, 1), (3, 3), (32, 32), (48, 24), (64, 32), (100, 25), (37, 1)]
)
def test_group_count(channels: int, groups: int) -> None:
    assert _group_count(channels) == groups


def test_package_exports_work_in_any_import_order() -> None:
    # The functions live in veil.validation, so importing it never shadows veil.validate.
    import veil.validation as module

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert veil.validate(model) == module.validate(model) == validate(model)
    assert len(veil.validate(model)) == 1
    assert veil.fix is fix
