"""A live progress bar for training: epoch, step, loss, ε spent so far, time left.

Quiet (a no-op) when disabled: with ``--json``, or when stdout is not a terminal. The loss shown is
the running loss of the sampled training batches, labelled non-private: a statistic of the private
batches shown to the operator who holds the data, never stored or released (the report's curves use
the held-out split and sit in its ``non_private`` section).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["CountProgress", "TrainingProgress", "progress_enabled"]


def progress_enabled(requested: bool | None) -> bool:
    """``requested`` if given, else whether stdout is an interactive terminal."""
    if requested is not None:
        return requested
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


_Bar = TypeVar("_Bar", bound="_RichBar")


class _RichBar:
    """The shared life cycle of a rich bar: built on ``__enter__`` only when enabled, closed on exit."""

    def __init__(self, enabled: bool, total: int, description: str) -> None:
        self.enabled = enabled
        self.total = total
        self.description = description
        self._progress: Any = None
        self._task: Any = None

    def _columns(self) -> list[Any]:
        raise NotImplementedError

    def _initial_fields(self) -> dict[str, Any]:
        return {}

    def __enter__(self: _Bar) -> _Bar:
        if not self.enabled:
            return self
        from rich.progress import Progress

        self._progress = Progress(*self._columns(), transient=False)
        self._progress.__enter__()
        self._task = self._progress.add_task(self.description, total=self.total, **self._initial_fields())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
            self._progress = None


class TrainingProgress(_RichBar):
    """``with TrainingProgress(enabled, total_steps, epochs) as bar: bar.update(...)``."""

    def __init__(
        self, enabled: bool, total_steps: int, epochs: int, description: str = "DP training"
    ) -> None:
        super().__init__(enabled, total_steps, description)
        self.epochs = epochs

    def _columns(self) -> list[Any]:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

        return [
            TextColumn("[bold]{task.description}"),
            TextColumn("epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("non-private train loss {task.fields[loss]}"),
            TextColumn("ε {task.fields[eps]}"),
            TimeRemainingColumn(),
        ]

    def _initial_fields(self) -> dict[str, Any]:
        return {"epoch": 0, "epochs": self.epochs, "loss": "-", "eps": "0"}

    def update(self, *, step: int, epoch: int, loss: float | None, epsilon: float) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task,
            completed=step,
            epoch=epoch,
            loss="-" if loss is None else f"{loss:.4f}",
            eps=f"{epsilon:.3f}",
        )


class CountProgress(_RichBar):
    """``with CountProgress(enabled, total, "teachers trained") as bar: bar.update(done)``: a bar for
    a count of finished tasks (no loss, no ε). Quiet when disabled."""

    def _columns(self) -> list[Any]:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

        return [
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
        ]

    def update(self, done: int, total: int | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total or self.total)
