"""The settings of one ``veil synth`` run, checked before any row is read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from veil.errors import ConfigError, InvalidParameterError

__all__ = ["MECHANISMS", "SynthSettings"]

Mechanism = Literal["mst", "aim"]
MECHANISMS: tuple[Mechanism, ...] = ("mst", "aim")
DEFAULT_MAX_CELLS = 10_000_000
"""Largest model (junction-tree cells, 8 bytes each: 80 MB), AIM's default size limit."""


@dataclass(frozen=True)
class SynthSettings:
    """What to synthesize from, with which mechanism and budget, and where to write it."""

    dataset: str
    schema: str
    epsilon: float
    delta: float
    rows: int
    mechanism: Mechanism = "mst"
    out: Path | None = None
    table: str | None = None
    query: str | None = None
    dataset_id: str | None = None
    """The declared identity the run is charged to (``--dataset-id``; default: the data's fingerprint)."""
    bins: int = 16
    degree: int = 3
    """AIM's workload: every marginal of this many columns."""
    max_cells: int = DEFAULT_MAX_CELLS
    iterations: int = 1000
    secure_rng: bool = True
    seed: int | None = None
    progress: bool = False
    privacy_unit: str | None = None
    """The column naming each row's person: each person's rows share one unit of weight in every
    marginal (:mod:`veil.synth.units`); None: each row is its own unit."""

    def __post_init__(self) -> None:
        for name in ("epsilon", "delta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidParameterError(
                    name, v, f"{name} sets the guarantee and must be > 0", f"pass --{name}"
                )
        if self.delta >= 1:
            raise InvalidParameterError("delta", self.delta, "δ is a probability below 1/N", "pass e.g. 1e-6")
        for name, low in (("rows", 1), ("iterations", 1), ("max_cells", 1), ("degree", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(name, v, f"{name} is a count", f"pass an integer ≥ {low}")
        if self.mechanism not in MECHANISMS:
            raise ConfigError(
                "mechanism", self.mechanism, "only MST and AIM are implemented", f"use one of {MECHANISMS}"
            )
        if self.secure_rng and self.seed is not None:
            raise InvalidParameterError(
                "seed",
                self.seed,
                "a seed makes the noise reproducible by whoever knows it, which secure mode rules out",
                "drop --seed, or pass --reproducible for a research run",
            )
