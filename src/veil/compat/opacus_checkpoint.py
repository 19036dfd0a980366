"""Opacus-style checkpoints (``save_checkpoint``/``load_checkpoint``) holding veil's engine state.

One file (``torch.save``) holds the model's state, the optimizer's, veil's full engine state (plan,
steps, the privacy ledger, RNG states; see :meth:`veil.PrivacyEngine.state_dict`) and whatever the user
adds in ``checkpoint_dict``. Loading restores the engine first: its checks (same privacy plan, intact
ledger) run before the model or optimizer is touched. Files load with ``weights_only=True`` by default
(no arbitrary code from a checkpoint); pass ``torch_load_kwargs={"weights_only": False}`` for a file
that holds other Python objects.
"""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from veil.errors import CheckpointError, InvalidParameterError

if TYPE_CHECKING:
    import os

__all__ = ["ENGINE_KEY", "EngineState", "load_checkpoint", "save_checkpoint"]


class EngineState(Protocol):
    """What a checkpoint needs of the engine (:class:`veil.PrivacyEngine`, whose ``save_checkpoint`` and
    ``load_checkpoint`` call this module): its state out and back in. Named by shape so that this module
    does not import the engine back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


ENGINE_KEY = "veil_engine_state_dict"
_MODULE_KEY = "module_state_dict"
_OPTIMIZER_KEY = "optimizer_state_dict"


def _refuse_schedulers(noise_scheduler: Any, grad_clip_scheduler: Any) -> None:
    for name, value in (("noise_scheduler", noise_scheduler), ("grad_clip_scheduler", grad_clip_scheduler)):
        if value is not None:
            raise InvalidParameterError(
                name,
                type(value).__name__,
                "veil fixes σ and the clip norm in a frozen privacy plan for the whole run, so each step's "
                "event is known in advance; Opacus's schedulers change them between steps",
                f"drop {name}",
            )


def save_checkpoint(
    engine: EngineState,
    *,
    path: str | os.PathLike[str] | IO[bytes],
    module: nn.Module,
    optimizer: Optimizer | None = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    checkpoint_dict: dict[str, Any] | None = None,
    module_state_dict_kwargs: dict[str, Any] | None = None,
    torch_save_kwargs: dict[str, Any] | None = None,
) -> None:
    """Write model, optimizer and engine state (and ``checkpoint_dict``) to ``path`` with ``torch.save``."""
    _refuse_schedulers(noise_scheduler, grad_clip_scheduler)
    extra = dict(checkpoint_dict or {})
    clash = sorted({ENGINE_KEY, _MODULE_KEY, _OPTIMIZER_KEY} & set(extra))
    if clash:
        raise InvalidParameterError(
            "checkpoint_dict", clash, "these keys hold the checkpoint's own states", "rename them"
        )
    state = {
        **extra,
        _MODULE_KEY: module.state_dict(**(module_state_dict_kwargs or {})),
        ENGINE_KEY: engine.state_dict(),  # refuses in the middle of a logical batch
    }
    if optimizer is not None:
        state[_OPTIMIZER_KEY] = optimizer.state_dict()
    torch.save(state, path, **(torch_save_kwargs or {}))


def load_checkpoint(
    engine: EngineState,
    *,
    path: str | os.PathLike[str] | IO[bytes],
    module: nn.Module,
    optimizer: Optimizer | None = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    module_load_dict_kwargs: dict[str, Any] | None = None,
    torch_load_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns the checkpoint without the optimizer state.

    Call after ``make_private`` with the same privacy settings (the engine refuses another plan).
    """
    _refuse_schedulers(noise_scheduler, grad_clip_scheduler)
    checkpoint = torch.load(path, **{"weights_only": True, **(torch_load_kwargs or {})})
    if not isinstance(checkpoint, dict) or ENGINE_KEY not in checkpoint or _MODULE_KEY not in checkpoint:
        raise CheckpointError(
            "checkpoint",
            sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__,
            "it holds no veil engine state, so the privacy spent before it cannot be restored (an Opacus "
            "checkpoint's accountant state is not veil's ledger)",
            "load a checkpoint written by veil's save_checkpoint",
        )
    optimizer_state = checkpoint.pop(_OPTIMIZER_KEY, None)
    if (optimizer is None) != (optimizer_state is None):
        raise CheckpointError(
            "optimizer",
            "given" if optimizer is not None else None,
            "the checkpoint "
            + ("has no" if optimizer_state is None else "has an")
            + " optimizer state; resuming without the matching one changes the run",
            "pass the optimizer exactly when the checkpoint was saved with one",
        )
    engine.load_state_dict(checkpoint[ENGINE_KEY])
    module.load_state_dict(checkpoint[_MODULE_KEY], **(module_load_dict_kwargs or {}))
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    return checkpoint
