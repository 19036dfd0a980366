"""The run report: ``report.json`` (stable field names), ``report.html`` and PNG plots.

:class:`Report` is what :func:`veil.train` returns and what ``report.json`` holds. Field names are
part of veil's interface: new fields may be added, existing ones keep their name and meaning.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["NON_PRIVATE_FIELDS", "Check", "DatasetInfo", "NonPrivate", "Report"]

# Figures computed from the private data without privacy. They belong in the report's one
# ``non_private`` section (or are labelled there by path, see NonPrivate.labelled_elsewhere); the
# ``no_unaccounted_data_use`` check fails when one turns up anywhere else.
NON_PRIVATE_FIELDS = frozenset(
    {
        "test_accuracy",
        "test_loss",
        "baseline_test_accuracy",
        "utility_drop",
        "train_loss",
        "loss",
        "history",
        "audit",
        "epsilon_lower_bound",
        "mia",
    }
)


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


class NonPrivate(BaseModel):
    """What a run computed from the private data *without* privacy: not covered by the guarantee.

    The test metrics are a non-private release about the held-out rows; the baseline trains on the
    private training split without noise; an audit measures the private model on private rows."""

    model_config = ConfigDict(extra="forbid")

    note: str = (
        "Not covered by the DP guarantee: computed from the private data without privacy, for the "
        "operator only. Keep this section internal; release model.pt."
    )
    test_accuracy: float
    """Accuracy of the released model on the held-out rows (a non-private release about them)."""
    baseline_test_accuracy: float | None
    """The same model trained without privacy on the private training split (None: --no-baseline)."""
    baseline_stopped: str | None = None
    """How the baseline's training ended: converged on its own validation split, or capped (then the
    utility cost of privacy may be understated); see :mod:`veil.pipeline.baseline`."""
    utility_drop: float | None
    history: dict[str, list[dict[str, float]]]
    """Per-epoch test loss/accuracy of the DP run ("dp") and of the baseline ("baseline")."""
    audit: dict[str, Any] | None = None
    per_record_rules: dict[str, int] = {}
    """How many rows or cells the schema's per-record rules touched (rows dropped for an undeclared or
    missing label, cells not a number made missing): counts over the private rows, without noise."""
    labelled_elsewhere: dict[str, str] = {}
    """Report paths outside this section that are non-private too, with why they stay there."""


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
    clipping: dict[str, Any] | None = None
    """How examples' gradients were clipped: ``mode`` (``fixed`` or ``adaptive``: the target quantile,
    initial and final C, the count's noise; C's path is released, a function of the noisy counts) and
    ``augment`` (K augmented copies averaged per example before clipping; the sensitivity stays C)."""
    # What was trained.
    dataset: DatasetInfo
    model: str
    parameters: int
    optimizer: str
    lr: float
    label_set: dict[str, Any]
    """{"source": "declared", "classes": [...], "declared_by": ...}: the output width is public."""
    pretrained: dict[str, Any] | None = None
    """``--init-from``: the checkpoint (path, SHA-256), who declared it public, what was trained and
    frozen, what was re-initialised; None when the model started from its seed."""
    # Randomness and release.
    randomness: str
    """"secure" (OS CSPRNG, the default) or "seeded" (research mode: replayable from the seed)."""
    release_ready: bool
    """True only with secure randomness and every check passed."""
    covers: str
    """Exactly what the (ε, δ) guarantee covers, in words."""
    seed: int
    """Seeds the data-independent choices (split key, initialisation, random features); the noise
    too in research mode only."""
    seed_role: str = (
        "the split and initialisation seed: it fixes the keyed train/test split, the initial weights and "
        "any random features (choices that do not depend on the data); the noise and sampling come "
        "from it only in research mode, otherwise from the OS CSPRNG, never stored"
    )
    """What ``seed`` seeds, in words (a seed of 0 is the default split/initialisation seed)."""
    veil_version: str
    duration_s: float
    resumes: int = 0
    world_size: int = 1
    """Processes that trained the model together (data parallel, veil.distributed); 1 without."""
    checks: list[Check]
    non_private: NonPrivate
    files: dict[str, str]
    out_dir: str
    privacy_unit: dict[str, Any] | None = None
    """``--privacy-unit``: ``column``, ``units`` (N, public by declaration), ``max_rows_per_unit`` (K)
    and ``rows_used_per_step`` (the public bound B·K); None for a row-level run (each row protected
    on its own, so a person with several rows only by group privacy)."""
    streaming: dict[str, Any] | None = None
    """How a ``--stream`` run read its Parquet file (windows, rows decoded, peak rows held); None
    for a run on a table in memory."""

    @property
    def all_checks_passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def secure_rng(self) -> bool:
        return self.randomness == "secure"

    # The non-private figures, by their former names (Python API; report.json has them in non_private).
    @property
    def test_accuracy(self) -> float:
        return self.non_private.test_accuracy

    @property
    def baseline_test_accuracy(self) -> float | None:
        return self.non_private.baseline_test_accuracy

    @property
    def utility_drop(self) -> float | None:
        return self.non_private.utility_drop

    @property
    def history(self) -> dict[str, list[dict[str, float]]]:
        return self.non_private.history

    @property
    def audit(self) -> dict[str, Any] | None:
        return self.non_private.audit

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the content of ``report.json``)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
