"""The forward-mixing probe runs the model in training mode, whatever mode it is handed in.

A module that mixes examples only while ``self.training`` (as BatchNorm does) would mix them during
training even if make_private saw it in eval mode; the probe must find it either way, and give the
model back with every submodule in the mode it had.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.engine import PrivacyEngine
from veil.errors import ModelNotSupportedError
from veil.mixing_probe import probe_forward, refuse_example_mixing


class MixesWhenTraining(nn.Module):
    """Subtracts the batch mean, but only in training mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True) if self.training else x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), MixesWhenTraining(), nn.Linear(4, 3)).double()


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(20, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (20,)))
    return DataLoader(data, batch_size=5)


def _modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_model_that_mixes_only_in_training_is_refused_in_either_mode(mode: str) -> None:
    model = _model()
    model.train(mode == "train")
    modes = _modes(model)
    engine = PrivacyEngine()
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=_loader(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    assert engine.plan is None and _modes(model) == modes


def test_the_whole_model_check_also_probes_in_training_mode() -> None:
    model = _model().eval()
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(8, 6)))
    with pytest.raises(ModelNotSupportedError, match="mixes examples"):
        refuse_example_mixing(model, x)
    assert not model.training


def test_every_submodule_gets_its_own_mode_back() -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5), nn.Linear(4, 3)).double()
    model.train()
    model[1].eval()  # a mixture of modes, restored module by module
    modes = _modes(model)
    assert probe_forward(model, _loader()) == "passed"
    assert _modes(model) == modes
    model.eval()
    assert probe_forward(model, _loader()) == "passed"
    assert not any(_modes(model))


class AttentionWithDropout(nn.Module):
    """Per-example self-attention over positions with attention and output dropout: nothing crosses
    the batch dimension, but the training-mode forward is random (as in a Hugging Face encoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x.view(x.shape[0], 3, 2).repeat(1, 1, 2))
        a = nn.functional.scaled_dot_product_attention(h, h, h, dropout_p=0.3 if self.training else 0.0)
        return self.drop(a).flatten(1)


def test_dropout_and_attention_dropout_are_not_mistaken_for_mixing() -> None:
    """Training-mode randomness is per element: the probe runs without it (it is not replayed exactly
    by fused attention kernels) and still finds a module that mixes only when training."""
    torch.manual_seed(0)
    model = nn.Sequential(AttentionWithDropout(), nn.Linear(12, 3)).double().eval()
    assert probe_forward(model, _loader()) == "passed"
    mixing = nn.Sequential(AttentionWithDropout(), MixesWhenTraining(), nn.Linear(12, 3)).double().eval()
    assert not isinstance(probe_forward(mixing, _loader()), str)
