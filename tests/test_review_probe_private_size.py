"""revK K6: with ``population=`` the dataset's own size is private, yet the example-mixing probe was
skipped below 2 rows — a mixing model was accepted at 0 and 1 rows and refused at 2, so one record
decided whether ``make_private`` refused. The probe's items are now shaped from the structural
template (:func:`veil.engine.wrapping.template_item`) whenever a population is given, so its verdict
never looks at ``len(dataset)``; without a population (the size is public) it is unchanged.

Planted: pass no template to ``wrapping.check_model`` in ``PrivacyEngine._check`` and
``test_a_mixing_model_is_refused_at_every_private_size`` fails (0 and 1 rows accepted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.engine import PrivacyEngine
from veil.errors import ModelNotSupportedError


class Centre(nn.Module):
    """Subtracts the batch mean: mixes examples through no module the static validator knows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True) if len(x) else x


def _make_private(model: nn.Module, n: int, population: int | None) -> PrivacyEngine:
    rows = TensorDataset(torch.randn(n, 3), torch.zeros(n, dtype=torch.long))
    engine = PrivacyEngine()
    engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(rows, batch_size=2), noise_multiplier=1.0, max_grad_norm=1.0,
        population=population,
    )  # fmt: skip
    return engine


@pytest.mark.parametrize("n", [0, 1, 2])
def test_a_mixing_model_is_refused_at_every_private_size(n: int) -> None:
    with pytest.raises(ModelNotSupportedError, match="changing one example"):
        _make_private(nn.Sequential(nn.Linear(3, 4), Centre(), nn.Linear(4, 2)), n, population=8)


def test_a_row_wise_model_is_accepted_at_every_private_size() -> None:
    for n in (0, 1, 2):
        _make_private(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), n, population=8)


def test_without_a_population_two_rows_are_probed() -> None:
    with pytest.raises(ModelNotSupportedError):
        _make_private(nn.Sequential(nn.Linear(3, 4), Centre(), nn.Linear(4, 2)), 2, population=None)
