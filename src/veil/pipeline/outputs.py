"""What jobs write besides their report page: the JSON cleaner and the released model's bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import nn

__all__ = ["finite", "held_out_accuracy", "model_bytes"]


def finite(value: Any) -> Any:
    """``value`` with every non-finite float as None and numpy scalars as Python ones (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, np.generic):
        return finite(value.item())
    return value


def held_out_accuracy(value: float | None) -> str:
    """A held-out accuracy as printed: four decimals, or "none" when no row was held out (the keyed
    split may leave the test side empty: no metric, never a refusal)."""
    if value is None or not math.isfinite(value):
        return "none (no held-out row)"
    return f"{value:.4f}"


def model_bytes(model: nn.Module) -> bytes:
    """The model's ``state_dict`` on the CPU, as ``torch.save`` bytes (``torch.load(weights_only=True)``)."""
    import torch

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    return buf.getvalue()
