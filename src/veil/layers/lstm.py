"""``DPLSTM``: ``nn.LSTM`` rebuilt from ``nn.Linear`` maps so that veil clips it exactly per example.

``nn.LSTM`` runs one fused kernel over the whole sequence; neither a layer rule nor the ``torch.func``
fallback can pull one example's gradient out of it. Here each layer and direction holds two linear
maps, ``ih`` (input → 4 gates, applied once to the whole sequence) and ``hh`` (hidden → 4 gates,
applied at every time step), with exactly ``nn.LSTM``'s equations and gate order (i, f, g, o). Each
example's output depends on that example alone, so veil's ``Linear`` rule (which sums a parameter's
per-example gradient over all of its calls before clipping) gives exact per-example gradients;
``tests/test_opacus_compat_layers.py`` checks them against a per-example loop and the forward against
``nn.LSTM`` with the same weights.

Parameters are named ``l{k}{_reverse}.ih.weight`` etc.; :meth:`DPLSTM.load_lstm` copies the weights of an
``nn.LSTM`` of the same shape (and :meth:`DPLSTM.to_lstm_state_dict` goes back), so a model can switch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.errors import InvalidParameterError

__all__ = ["DPLSTM"]


class _Direction(nn.Module):
    """One layer, one direction of an LSTM over batch-first input ``[B, T, F]``."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool) -> None:
        super().__init__()
        self.ih = nn.Linear(input_size, 4 * hidden_size, bias=bias)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size, bias=bias)

    def forward(self, x: Tensor, h: Tensor, c: Tensor, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
        gates_in = self.ih(x)
        steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
        outputs: list[Tensor] = [h] * x.shape[1]
        for t in steps:
            i, f, g, o = (gates_in[:, t] + self.hh(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs[t] = h
        return torch.stack(outputs, dim=1), h, c


class DPLSTM(nn.Module):
    """Drop-in for ``nn.LSTM`` (and Opacus's ``DPLSTM``): same arguments, inputs and outputs.

    ``forward(input, hx=None)`` returns ``(output, (h_n, c_n))`` shaped as ``nn.LSTM``'s: ``output`` is
    ``[B, T, D·H]`` with ``batch_first=True`` (``[T, B, D·H]`` otherwise), ``h_n``/``c_n`` are
    ``[num_layers·D, B, H]``. ``proj_size`` is not supported (refused). Unbatched (2-d) input is
    refused: per-example clipping needs a batch dimension.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
    ) -> None:
        super().__init__()
        if proj_size:
            raise InvalidParameterError(
                "proj_size",
                proj_size,
                "DPLSTM has no projection layer yet",
                "use proj_size=0 (or a Linear after the LSTM)",
            )
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bias, batch_first, bidirectional
        self.num_directions = 2 if bidirectional else 1
        self.drop = nn.Dropout(dropout)
        for k in range(num_layers):
            width = input_size if k == 0 else hidden_size * self.num_directions
            for suffix in self._suffixes():
                self.add_module(f"l{k}{suffix}", _Direction(width, hidden_size, bias))

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if input.dim() != 3:
            raise InvalidParameterError(
                "input",
                tuple(input.shape),
                "per-example clipping needs a batch dimension",
                "pass a 3-d input (add a batch dimension of 1 for a single sequence)",
            )
        x = input if self.batch_first else input.transpose(0, 1)
        batch, layers_dirs = x.shape[0], self.num_layers * self.num_directions
        if hx is None:
            zeros = x.new_zeros(layers_dirs, batch, self.hidden_size)
            hx = (zeros, zeros)
        h0, c0 = hx
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for k in range(self.num_layers):
            outs = []
            for d, suffix in enumerate(self._suffixes()):
                cell: _Direction = getattr(self, f"l{k}{suffix}")
                j = k * self.num_directions + d
                out, h, c = cell(x, h0[j], c0[j], reverse=d == 1)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            x = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
            if k + 1 < self.num_layers:
                x = self.drop(x)
        output = x if self.batch_first else x.transpose(0, 1)
        return output, (torch.stack(h_n), torch.stack(c_n))

    @torch.no_grad()
    def load_lstm(self, lstm: nn.LSTM) -> DPLSTM:
        """Copy the weights of an ``nn.LSTM`` of the same shape into this module; returns ``self``."""
        for k in range(self.num_layers):
            for suffix in self._suffixes():
                cell: _Direction = getattr(self, f"l{k}{suffix}")
                cell.ih.weight.copy_(getattr(lstm, f"weight_ih_l{k}{suffix}"))
                cell.hh.weight.copy_(getattr(lstm, f"weight_hh_l{k}{suffix}"))
                if self.bias:
                    cell.ih.bias.copy_(getattr(lstm, f"bias_ih_l{k}{suffix}"))
                    cell.hh.bias.copy_(getattr(lstm, f"bias_hh_l{k}{suffix}"))
        return self

    def to_lstm_state_dict(self) -> dict[str, Tensor]:
        """This module's weights under ``nn.LSTM``'s parameter names."""
        out: dict[str, Tensor] = {}
        for k in range(self.num_layers):
            for suffix in self._suffixes():
                cell: _Direction = getattr(self, f"l{k}{suffix}")
                out[f"weight_ih_l{k}{suffix}"] = cell.ih.weight.detach().clone()
                out[f"weight_hh_l{k}{suffix}"] = cell.hh.weight.detach().clone()
                if self.bias:
                    out[f"bias_ih_l{k}{suffix}"] = cell.ih.bias.detach().clone()
                    out[f"bias_hh_l{k}{suffix}"] = cell.hh.bias.detach().clone()
        return out
