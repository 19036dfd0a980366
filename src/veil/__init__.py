"""veil: differentially private training for PyTorch.

Importing ``veil`` is cheap: heavy modules (torch, scipy, matplotlib) load only when the feature
that needs them is first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PrivacyEngine": "veil.engine",
    "validate": "veil.validation",
    "fix": "veil.validation",
    "train": "veil.training",
    "calibrate_noise": "veil.accounting.calibrate",
    "dpsgd_epsilon": "veil.accounting.calibrate",
    "max_steps": "veil.accounting.calibrate",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'veil' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
