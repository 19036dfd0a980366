"""Built-in layer rules; importing this package registers them."""

from __future__ import annotations

from veil.clipping.rules import attention, conv, embedding, linear, norm

__all__ = ["attention", "conv", "embedding", "linear", "norm"]
