"""File names of a federated run folder (see :mod:`veil.federated.server` for what each holds)."""

from __future__ import annotations

from veil.pipeline.run_folder import LEDGER

__all__ = ["CHECKPOINT", "ERROR", "HISTORY", "LEDGER", "MODEL", "SETTINGS", "SILOS"]

CHECKPOINT = "checkpoint.npz"
HISTORY = "history.json"
MODEL = "model.npz"
SILOS = "silos.json"
ERROR = "error.txt"
SETTINGS = "settings.json"
