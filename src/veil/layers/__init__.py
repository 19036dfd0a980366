"""Opacus's layer names, for modules veil clips exactly per example.

* :class:`DPLSTM`: an LSTM built from ``nn.Linear`` maps (``nn.LSTM``'s fused kernel cannot be
  differentiated per example by veil's rules or by ``torch.func``), same signature, parameters and
  outputs as ``nn.LSTM``; its linear maps are clipped by veil's exact ``Linear`` rule.
* :data:`DPMultiheadAttention`: ``nn.MultiheadAttention`` itself, which veil's attention rule already
  clips exactly (no separate class: one name, one module).

Importing this package imports torch; ``import veil`` does not.
"""

from __future__ import annotations

from torch import nn

from veil.layers.lstm import DPLSTM

DPMultiheadAttention = nn.MultiheadAttention

__all__ = ["DPLSTM", "DPMultiheadAttention"]
