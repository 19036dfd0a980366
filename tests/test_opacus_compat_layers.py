"""veil.layers: DPLSTM equals nn.LSTM and is clipped exactly per example; DPMultiheadAttention is nn's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil import PrivacyEngine
from veil.errors import InvalidParameterError
from veil.layers import DPLSTM, DPMultiheadAttention


@pytest.mark.parametrize(("batch_first", "bidirectional", "layers"), [(True, True, 2), (False, False, 1)])
def test_dplstm_forward_equals_nn_lstm(batch_first: bool, bidirectional: bool, layers: int) -> None:
    torch.manual_seed(0)
    kwargs = {"num_layers": layers, "batch_first": batch_first, "bidirectional": bidirectional}
    reference = nn.LSTM(3, 5, **kwargs).double()
    ours = DPLSTM(3, 5, **kwargs).double().load_lstm(reference)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    d = 2 if bidirectional else 1
    hx = (torch.randn(layers * d, 4 if batch_first else 6, 5, dtype=torch.float64),) * 2
    for args in ((x,), (x, hx)):
        (a, (h, c)), (b, (h2, c2)) = reference(*args), ours(*args)
        for got, want in ((b, a), (h2, h), (c2, c)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    state = ours.to_lstm_state_dict()
    assert set(state) == set(reference.state_dict())
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def test_dplstm_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(InvalidParameterError, match="proj_size"):
        DPLSTM(3, 5, proj_size=2)
    with pytest.raises(InvalidParameterError, match="batch dimension"):
        DPLSTM(3, 5)(torch.randn(6, 3))


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = DPLSTM(3, 4, num_layers=2, batch_first=True, bidirectional=True)
        self.attention = DPMultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        h, _ = self.attention(h, h, h)
        return self.head(h[:, -1])


def test_layers_clipped_exactly_per_example() -> None:
    """σ = 0, q = 1: the update equals the per-example loop's clipped sum (independent reference)."""
    assert DPMultiheadAttention is nn.MultiheadAttention
    torch.manual_seed(0)
    x, y = torch.randn(6, 5, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    reference = _Tagger().double()
    model = copy.deepcopy(reference)
    C = 0.05
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
        noise_multiplier=0.0,
        max_grad_norm=C,
        loss_reduction="sum",
    )
    for xb, yb in loader:
        assert len(xb) == 6
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        optimizer.step()
    total = [torch.zeros_like(p) for p in reference.parameters()]
    clipped = 0
    for i in range(6):
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        grads = [p.grad for p in reference.parameters()]
        norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
        clipped += norm > C
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, C / norm)
    assert clipped > 0
    for before, after, t in zip(reference.parameters(), model.parameters(), total, strict=True):
        torch.testing.assert_close((before - after).detach() * 6, t, rtol=1e-7, atol=1e-10)
