"""The run report: ``report.json`` (stable field names), ``report.html`` and PNG plots.

:class:`Report` is what :func:`veil.train` returns and what ``report.json`` holds. Field names are
part of veil's interface: new fields may be added, existing ones keep their name and meaning.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Check", "DatasetInfo", "Report"]


class Check(BaseModel):
    """One item of the verification checklist."""

    model_config = ConfigDict(extra="forbid")

    name: str
    passed: bool
    detail: str


class DatasetInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    n_train: int
    n_test: int
    sha256: str
    kind: str
    num_classes: int


class Report(BaseModel):
    """Everything a data-protection officer needs to file about one ``veil train`` run."""

    model_config = ConfigDict(extra="forbid")

    # The guarantee.
    epsilon_spent: float
    target_epsilon: float
    delta: float
    accountant: str
    neighbouring: str = "add_or_remove_one"
    noise_multiplier: float
    max_grad_norm: float
    sampling: str = "poisson"
    sampling_rate: float
    batch_size: int
    steps: int
    steps_planned: int
    epochs: int
    stopped_early: bool = False
    stop_reason: str | None = None
    preprocessing: dict[str, Any]
    # What was trained.
    dataset: DatasetInfo
    model: str
    parameters: int
    optimizer: str
    lr: float
    # Utility.
    test_accuracy: float
    baseline_test_accuracy: float | None
    utility_drop: float | None
    # Reproducibility and audit.
    seed: int
    secure_rng: bool
    veil_version: str
    duration_s: float
    resumes: int = 0
    world_size: int = 1
    """Processes that trained the model together (data parallel, veil.distributed); 1 without."""
    checks: list[Check]
    audit: dict[str, Any] | None = None
    history: dict[str, list[dict[str, float]]]
    files: dict[str, str]
    out_dir: str

    @property
    def all_checks_passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the content of ``report.json``)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
