"""The search space of ``veil tune`` and its draws.

Each trial's hyperparameters are drawn uniformly from the listed values with the OS CSPRNG
(``secrets``), independently of the data: the tuning bound (:mod:`veil.accounting.tuning`) assumes
the trial mechanism's randomness, hyperparameters included, is data-independent.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any

from veil.errors import InvalidParameterError

__all__ = ["Candidate", "SearchSpace"]


@dataclass(frozen=True)
class Candidate:
    """One trial's hyperparameters."""

    lr: float
    epochs: int
    batch_size: int
    max_grad_norm: float
    model: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SearchSpace:
    """Finite lists of values; a trial takes one value of each, uniformly at random."""

    lr: tuple[float, ...] = (0.4, 0.8, 1.6)
    epochs: tuple[int, ...] = (5, 10)
    batch_size: tuple[int, ...] = (128, 256)
    max_grad_norm: tuple[float, ...] = (0.5, 1.0)
    model: tuple[str, ...] = field(default=("auto",))

    def __post_init__(self) -> None:
        for name in ("lr", "epochs", "batch_size", "max_grad_norm", "model"):
            values = getattr(self, name)
            if not values:
                raise InvalidParameterError(
                    name, values, "a search dimension needs at least one value to draw from", "list ≥ 1 value"
                )
            if name != "model" and any(not (v > 0) for v in values):
                raise InvalidParameterError(name, values, "every value must be positive", "drop the others")

    @property
    def budget_shapes(self) -> list[tuple[int, int]]:
        """The (epochs, batch size) pairs: the only dimensions that change a trial's privacy cost."""
        return sorted(set(product(self.epochs, self.batch_size)))

    def draw(self) -> Candidate:
        """One candidate, each dimension drawn with ``secrets.choice``."""
        return Candidate(
            lr=float(secrets.choice(self.lr)),
            epochs=int(secrets.choice(self.epochs)),
            batch_size=int(secrets.choice(self.batch_size)),
            max_grad_norm=float(secrets.choice(self.max_grad_norm)),
            model=str(secrets.choice(self.model)),
        )

    def to_dict(self) -> dict[str, list[Any]]:
        return {k: list(v) for k, v in asdict(self).items()}
