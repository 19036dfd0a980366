"""Mixed precision for DP-SGD: the forward pass under bfloat16 autocast (``--precision bf16``).

Only the forward pass (and the matching backward kernels autocast picks) runs in bfloat16. The
model's parameters stay float32; the clipper takes per-sample norms and clip factors in float32 from
the bf16 activations and output gradients, accumulates the clipped sum in float32 (at least the
parameter dtype promoted to float32) and the optimizer adds float32 noise to it (see
:mod:`veil.clipping.clipper`). The guarantee is unchanged: each example's clipped contribution has
norm ≤ C in the dtype that is summed, and the noise is calibrated to that C. What bf16 costs is
precision of the gradient direction (about 3 significant digits), not privacy.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

from veil.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PRECISIONS", "Precision", "autocast"]

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")


def autocast(device: str | torch.device, precision: str = "fp32") -> contextlib.AbstractContextManager[Any]:
    """The forward-pass context for ``precision``: bf16 autocast on the device's type, or nothing
    for fp32. bf16 is refused on a CUDA device without bf16 support rather than emulated slowly."""
    import torch

    device_type = torch.device(device).type
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ConfigError("precision", precision, "unknown precision", "use fp32 or bf16")
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "precision", precision, "this GPU has no bfloat16 support", "use --precision fp32 on this GPU"
        )
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
