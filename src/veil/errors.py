"""Domain exceptions for veil.

Every error carries one message format, built by :func:`format_problem`:

    <name>=<value>: <why it matters for privacy>. Fix: <what to do>.

The CLI prints ``str(error)`` as a single line and exits with status 2, so the message must be
self-contained. Subclasses say *which* part of veil refused; all are :class:`VeilError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "BudgetExhaustedError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "InvalidParameterError",
    "LedgerError",
    "ModelNotSupportedError",
    "Problem",
    "RegistryError",
    "RunInterrupted",
    "SamplingError",
    "UnreachableTargetError",
    "UnsupportedEventError",
    "VeilError",
    "format_problem",
]


def format_problem(name: str, value: Any, reason: str, fix: str) -> str:
    """The one message format: the value, why it matters for privacy, the fix."""
    reason = reason.rstrip(". ")
    fix = fix.rstrip(". ")
    return f"{name}={value!r}: {reason}. Fix: {fix}."


class VeilError(Exception):
    """Base class of every error veil raises on purpose."""

    def __init__(self, name: str, value: Any, reason: str, fix: str) -> None:
        self.name = name
        self.value = value
        self.reason = reason
        self.fix = fix
        super().__init__(format_problem(name, value, reason, fix))


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run whose folder can be continued: a KeyboardInterrupt that knows the folder.

    Raised only after the run folder and its ledger exist (every step taken is in the ledger), so
    ``veil COMMAND --resume RUN_DIR`` continues it (``train``, ``federated``); before that, a plain
    KeyboardInterrupt leaves nothing."""

    def __init__(self, run_dir: str, command: str = "train") -> None:
        self.run_dir = run_dir
        super().__init__(f"interrupted; continue with: veil {command} --resume {run_dir}")


class InvalidParameterError(VeilError, ValueError):
    """A parameter is outside the range where the privacy guarantee holds."""


class UnsupportedEventError(VeilError, TypeError):
    """An accountant was asked to compose an event it cannot account for."""


class UnreachableTargetError(VeilError, ValueError):
    """No setting in the searched range reaches the requested privacy target."""


class BudgetExhaustedError(VeilError, RuntimeError):
    """The next step would spend more privacy budget than allowed."""


class SamplingError(VeilError, ValueError):
    """The batch sampling cannot be accounted as claimed (e.g. shuffling accounted as Poisson)."""


class ConfigError(VeilError, ValueError):
    """A configuration file or flag is invalid."""


class DataError(VeilError, ValueError):
    """Input data is missing, malformed or unusable."""


class LedgerError(VeilError, RuntimeError):
    """The privacy ledger of a run is corrupted, mismatched or locked."""


class CheckpointError(VeilError, RuntimeError):
    """A checkpoint is corrupted or does not match its run."""


class RegistryError(VeilError, RuntimeError):
    """The privacy-budget registry cannot be reached, or refuses a record that would misstate spend."""


class Problem:
    """One problem found by a validator: where, what, and the fix. Validators return all at once."""

    __slots__ = ("fix", "location", "reason")

    def __init__(self, location: str, reason: str, fix: str) -> None:
        self.location = location
        self.reason = reason
        self.fix = fix

    def __repr__(self) -> str:
        return f"Problem({self.location!r}, {self.reason!r}, {self.fix!r})"

    def __str__(self) -> str:
        return f"{self.location}: {self.reason.rstrip('. ')}. Fix: {self.fix.rstrip('. ')}."

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Problem) and (self.location, self.reason, self.fix) == (
            other.location,
            other.reason,
            other.fix,
        )

    def __hash__(self) -> int:
        return hash((self.location, self.reason, self.fix))


class ModelNotSupportedError(VeilError, ValueError):
    """A model cannot be trained privately as it is; carries every problem found."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        listed = "; ".join(f"{p.location}: {p.reason} (fix: {p.fix})" for p in self.problems)
        super().__init__(
            "model",
            f"{len(self.problems)} problem(s)",
            f"per-example privacy cannot be guaranteed: {listed}",
            "apply the listed fixes, or call veil.fix(model) for the automatic ones",
        )
