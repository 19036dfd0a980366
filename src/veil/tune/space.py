"""The search space of ``veil tune`` and its draws.

Each trial's hyperparameters are drawn with the OS CSPRNG (``secrets``), independently of the data:
with probability ``preset_share`` the preset (``veil train``'s defaults for the data's kind, a public
choice), otherwise one value of each list uniformly. The tuning bound (:mod:`veil.accounting.tuning`)
assumes every trial is drawn i.i.d. from one data-independent law, which this mixture is.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any

from veil.errors import InvalidParameterError

__all__ = ["PRESET_SHARE", "Candidate", "SearchSpace", "around_preset"]

# The default chance that a trial is the preset itself (public; docs/tune.md).
PRESET_SHARE = 0.5


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
    """Finite lists of values; a trial is ``preset`` with probability ``preset_share``, else one
    value of each list, uniformly at random."""

    lr: tuple[float, ...] = (0.4, 0.8, 1.6)
    epochs: tuple[int, ...] = (5, 10)
    batch_size: tuple[int, ...] = (128, 256)
    max_grad_norm: tuple[float, ...] = (0.5, 1.0)
    model: tuple[str, ...] = field(default=("auto",))
    preset: Candidate | None = None
    preset_share: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.preset_share <= 1.0) or (self.preset_share > 0 and self.preset is None):
            raise InvalidParameterError(
                "preset_share",
                self.preset_share,
                "the chance of drawing the preset is a probability, and needs a preset",
                "pass a share in [0, 1]",
            )
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
        """The (epochs, batch size) pairs a trial can have (the preset's included): the only dimensions
        that change a trial's privacy cost."""
        shapes = set(product(self.epochs, self.batch_size))
        if self.preset is not None and self.preset_share > 0:
            shapes.add((self.preset.epochs, self.preset.batch_size))
        return sorted(shapes)

    def draw(self) -> Candidate:
        """One candidate: the preset with probability ``preset_share`` (a 53-bit uniform from
        ``secrets``), else each dimension drawn with ``secrets.choice``."""
        if self.preset is not None and secrets.randbits(53) < self.preset_share * 2.0**53:
            return self.preset
        return Candidate(
            lr=float(secrets.choice(self.lr)),
            epochs=int(secrets.choice(self.epochs)),
            batch_size=int(secrets.choice(self.batch_size)),
            max_grad_norm=float(secrets.choice(self.max_grad_norm)),
            model=str(secrets.choice(self.model)),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: list(getattr(self, k)) for k in DIMENSIONS}
        out["preset"] = None if self.preset is None else self.preset.to_dict()
        out["preset_share"] = self.preset_share
        return out


DIMENSIONS = ("lr", "epochs", "batch_size", "max_grad_norm", "model")


def around_preset(
    preset: Candidate, given: dict[str, tuple[Any, ...]] | None = None, preset_share: float = PRESET_SHARE
) -> SearchSpace:
    """The default space: the preset's learning rate halved and doubled, its epochs halved, its batch
    size, clip norm and model; a dimension in ``given`` (the user's lists) replaces the default one.
    Built from the preset alone (public: the data's kind and shape, and N for a table's batch)."""
    default: dict[str, tuple[Any, ...]] = {
        "lr": (preset.lr / 2, preset.lr, preset.lr * 2),
        "epochs": tuple(sorted({max(1, preset.epochs // 2), preset.epochs})),
        "batch_size": (preset.batch_size,),
        "max_grad_norm": (preset.max_grad_norm,),
        "model": (preset.model,),
    }
    return SearchSpace(**{**default, **(given or {})}, preset=preset, preset_share=preset_share)
