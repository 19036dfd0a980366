"""One report schema for every job, and the builder that labels each field as it is added.

Every job's ``report.json`` (train, tune, pate, synth, federated, audit) has the same top-level
sections, stated as a JSON Schema in ``docs/report-schema.json``:

- ``schema`` (:data:`SCHEMA_ID`) and ``job``;
- ``summary``: one paragraph in plain words, for a reader who is not a privacy expert;
- ``guarantee``: ``epsilon``, ``delta``, ``unit``, ``neighbouring``, ``accountant``, ``covers``,
  ``randomness``, ``release_ready``, ``statement`` (the technical text) and ``evidence`` (what ε is
  computed from: the ledger or the charged events);
- ``dataset_budget``: the dataset's budget and composed spend from the registry, this run included;
- ``non_private``: what was computed from the private data without noise, the released model's
  held-out accuracy always as ``test_accuracy``;
- ``files``: each file of the run folder and what it holds; ``release``: what ``release/`` holds;
- ``checks``: the verification checklist;
- ``<job>``: the job's own section (settings, plan, released values).

:class:`ReportBuilder` is the one way to assemble that dict. Each value is added with its label:
:meth:`~ReportBuilder.released` (computed from the private data and released: it takes the
:class:`Evidence` of the DP events behind it, which must be the guarantee's own),
:meth:`~ReportBuilder.public` (settings, the plan, declared facts: nothing read from private rows) or
:meth:`~ReportBuilder.non_private`. A name known to be computed without noise
(:data:`NON_PRIVATE_NAMES`) is refused anywhere but the ``non_private`` section, so it cannot reach the
released part by mistake. Another top-level section (a job-independent one such as ``privacy_unit``)
is one call to :meth:`~ReportBuilder.section`.

Deprecated aliases: until the next release, each key of the job's section is repeated at the top level
(the report's former layout; listed in ``deprecated_aliases``), except where it would collide with a
common section. Readers should move to ``report["<job>"][key]``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "COMMON",
    "NON_PRIVATE_NAMES",
    "SCHEMA_ID",
    "Evidence",
    "Guarantee",
    "ReportBuilder",
    "label",
    "public_view",
]

SCHEMA_ID = "veil.report/1"
Job = Literal["train", "tune", "pate", "synth", "federated", "audit"]

COMMON = (
    "schema",
    "job",
    "summary",
    "guarantee",
    "dataset_budget",
    "non_private",
    "files",
    "release",
    "checks",
    "deprecated_aliases",
)
"""The top-level sections every report has (its job's section aside)."""

NON_PRIVATE_NAMES = frozenset(
    {
        "test_accuracy",
        "test_loss",
        "baseline_test_accuracy",
        "utility_drop",
        "history_test",
        "trials",
        "trials_run",
        "teacher_sizes",
        "teacher_accuracy",
        "label_accuracy",
        "student_test_accuracy",
        "final_test_accuracy",
        "public_private_duplicates",
        "n_private",
        "vote_margins",
        "epsilon_lower_bound",
        "mia",
        "checks_on_n",
    }
)
"""Names of figures computed from private data without noise: only in ``non_private``."""


@dataclass(frozen=True)
class Evidence:
    """The DP events a released value rests on: where they are recorded and the events themselves."""

    source: str
    """Where the events are recorded (``ledger.jsonl``, or what the job charged)."""
    events: tuple[Mapping[str, Any], ...]

    def __post_init__(self) -> None:
        if not self.events:
            raise ValueError(
                f"no DP event behind '{self.source}': nothing data-derived can be released on it"
            )

    @classmethod
    def of(cls, source: str, events: Iterable[Any]) -> Evidence:
        """Evidence from privacy events (objects with ``to_dict``, or their dicts)."""
        return cls(source, tuple(e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in events))

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "events": len(self.events)}


@dataclass(frozen=True)
class Guarantee:
    """The one guarantee object every report states (``None`` ε: the job releases nothing private)."""

    epsilon: float | None
    delta: float | None
    unit: str
    """What one protected individual is: ``row``, ``group``, ``client``, ``record of one silo``."""
    neighbouring: str
    accountant: str
    covers: str
    randomness: Literal["secure", "seeded"]
    release_ready: bool
    statement: str
    evidence: Evidence | None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Job-specific facts of the guarantee (the federated mode, the data-dependent ε, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **dict(self.extra),
            "epsilon": self.epsilon,
            "delta": self.delta,
            "unit": self.unit,
            "neighbouring": self.neighbouring,
            "accountant": self.accountant,
            "covers": self.covers,
            "randomness": self.randomness,
            "release_ready": self.release_ready,
            "statement": self.statement,
            "evidence": None if self.evidence is None else self.evidence.to_dict(),
        }


class ReportBuilder:
    """Assemble one job's ``report.json`` with every field labelled (see the module doc)."""

    def __init__(self, job: Job, guarantee: Guarantee) -> None:
        self.job = job
        self.guarantee = guarantee
        self._job: dict[str, Any] = {}
        self._non_private: dict[str, Any] = {}
        self._sections: dict[str, Any] = {}
        self._files: dict[str, str] = {}
        self._release: list[str] = []
        self._checks: list[dict[str, Any]] = []
        self.summary = ""
        self.dataset_budget: dict[str, Any] | None = None

    # -- the job's section ------------------------------------------------------------------------
    def public(self, key: str, value: Any) -> ReportBuilder:
        """A setting, the plan or a declared fact: nothing read from private rows."""
        self._refuse_non_private_name(key, value)
        self._job[key] = value
        return self

    def public_fields(self, values: Mapping[str, Any]) -> ReportBuilder:
        for key, value in values.items():
            self.public(key, value)
        return self

    def released(self, key: str, value: Any, evidence: Evidence) -> ReportBuilder:
        """A value computed from the private data, released under the guarantee's DP events."""
        own = self.guarantee.evidence
        if own is None or not set(map(_canonical, evidence.events)) <= set(map(_canonical, own.events)):
            raise ValueError(
                f"'{key}' is released on events the guarantee does not cover ({evidence.source}): "
                "state it under the guarantee's evidence, or add it with non_private()"
            )
        self._refuse_non_private_name(key, value)
        self._job[key] = value
        return self

    def non_private(self, key: str, value: Any) -> ReportBuilder:
        """A figure computed from the private data without noise: internal, never released."""
        self._non_private[key] = value
        return self

    def non_private_fields(self, values: Mapping[str, Any]) -> ReportBuilder:
        self._non_private.update(values)
        return self

    # -- the other sections -----------------------------------------------------------------------
    def section(self, name: str, value: Any) -> ReportBuilder:
        """Another top-level section (e.g. ``privacy_unit``), the same in every job's report."""
        if name in COMMON or name == self.job:
            raise ValueError(f"'{name}' is a section the builder writes itself")
        self._refuse_non_private_name(name, value)
        self._sections[name] = value
        return self

    def file(
        self, name: str, what: str, *, release: bool = False, non_private: bool = False
    ) -> ReportBuilder:
        """A file of the run folder; ``release``: also in ``release/``; ``non_private``: labelled so."""
        self._files[name] = label(what, non_private)
        if release:
            self.release_file(name)
        return self

    def release_file(self, name: str) -> ReportBuilder:
        """``name`` is also written to ``release/`` (the report's own files: their public version)."""
        if name not in self._release:
            self._release.append(name)
        return self

    def check(self, name: str, passed: bool, detail: str) -> ReportBuilder:
        self._checks.append({"name": name, "passed": bool(passed), "detail": detail})
        return self

    def checks(self, checks: Sequence[Any]) -> ReportBuilder:
        for c in checks:
            c = c if isinstance(c, Mapping) else c.model_dump()
            self.check(c["name"], c["passed"], c["detail"])
        return self

    # -- the result -------------------------------------------------------------------------------
    def build(self, *, aliases: bool = True) -> dict[str, Any]:
        """The report's dict (``report.json``), the job's keys also at the top level as deprecated aliases."""
        from veil.pipeline.outputs import finite

        if not self.summary.strip():
            raise ValueError("a report needs its plain summary (ReportBuilder.summary) before it is built")
        non_private = {"note": _NOTE, "test_accuracy": None, **self._non_private}
        report: dict[str, Any] = {
            "schema": SCHEMA_ID,
            "job": self.job,
            "summary": self.summary,
            "guarantee": self.guarantee.to_dict(),
            "dataset_budget": self.dataset_budget,
            "non_private": non_private,
            "files": dict(self._files),
            "release": {"folder": "release", "files": list(self._release)},
            "checks": list(self._checks),
            **self._sections,
            self.job: dict(self._job),
        }
        kept = [k for k in self._job if k not in report] if aliases else []
        report.update({k: self._job[k] for k in kept})
        report["deprecated_aliases"] = kept
        return dict(finite(report))

    @staticmethod
    def _refuse_non_private_name(key: str, value: Any) -> None:
        found = [p for p in _paths(key, value) if p.rsplit(".", 1)[-1] in NON_PRIVATE_NAMES]
        if found:
            raise ValueError(
                f"{', '.join(found)}: computed without noise, so it belongs in non_private, not in the "
                "released part of the report"
            )


def label(what: str, non_private: bool) -> str:
    """A file's description, labelled when it holds figures computed without noise."""
    prefix = "INTERNAL, non-private: "
    return prefix + what if non_private and not what.startswith(prefix) else what


_NOTE = (
    "Not covered by the privacy guarantee: computed from the private data without noise, for the "
    "operator only. Keep it internal; release only what the release/ folder holds."
)


def _canonical(event: Mapping[str, Any]) -> str:
    import json

    return json.dumps(event, sort_keys=True, default=str)


def _paths(key: str, value: Any) -> Iterable[str]:
    yield key
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _paths(f"{key}.{k}", v)


WITHHELD_ID = "withheld (a fingerprint of the private file; the operator's report holds it)"
"""The released ``dataset_budget.dataset_id`` when the section names no id fit to release."""


def public_view(report: Mapping[str, Any]) -> dict[str, Any]:
    """What ``release/report.json`` holds: the report without ``non_private``, without the paths it
    labels non-private elsewhere (``non_private.labelled_elsewhere``), without local paths and the
    run's wall time (``duration_s``: it grows with the sampled batches' sizes), without
    the users and report folders of the dataset's runs, without the other runs' statuses (revJ's J6:
    "reserved" or "committed" when the report is written tells whether that run had ended; the runs
    listed are those admitted up to this one, :func:`veil.registry.reporting.as_found`), and with the
    dataset named by its released id
    (``dataset_budget.released_id``: never the content fingerprint, which is a function of the private
    rows; :mod:`veil.registry.public_ids`), or :data:`WITHHELD_ID` when the section names none; a
    ``label`` that is or holds that fingerprint is replaced by the same released id."""
    from veil.registry.reporting import public_label

    out = copy.deepcopy(dict(report))
    labelled = (out.pop("non_private", None) or {}).get("labelled_elsewhere") or {}
    job = out.get("job")
    for path in list(labelled):
        for root in (out, out.get(job) if isinstance(job, str) else None):
            _drop(root, path.split("."))
    for root in (out, out.get(job) if isinstance(job, str) else None):
        if isinstance(root, dict):
            root.pop("out_dir", None)
            # The wall time grows with the Poisson batches' sizes and, for texts, their padded
            # lengths: a function of the private rows, released by no mechanism.
            root.pop("duration_s", None)
    released = set((out.get("release") or {}).get("files") or [])
    out["files"] = {k: v for k, v in (out.get("files") or {}).items() if k in released}
    out["files"].update(_PUBLIC_FILES)
    budget = out.get("dataset_budget")
    if isinstance(budget, dict):
        # The registry's id of a file read without --dataset-id is its SHA-256, a function of every
        # private row: the release names the dataset by the registry's random id for it instead.
        key = str(budget.get("dataset_id"))
        budget["dataset_id"] = budget.pop("released_id", None) or WITHHELD_ID
        label = budget.get("label")
        hidden = not isinstance(label, str) or public_label(label, key, None) is None
        if key != budget["dataset_id"] and hidden:
            budget["label"] = budget["dataset_id"]  # nor through the label (:func:`public_label`)
        # who ran what, and where on this machine: for the DPO only; nor another run's status, which
        # moves when that run ends ("reserved" → "committed") and so would tell its duration (J6)
        budget["runs"] = [
            {
                k: v
                for k, v in r.items()
                if k not in ("user", "report", *(() if r.get("this_run") else ("status",)))
            }
            for r in budget["runs"]
        ]
    return out


_PUBLIC_FILES = {
    "report.json": "this report without its non_private section, machine-readable",
    "report.html": "this report without its non_private section, as a page",
}


def _drop(root: Any, parts: list[str]) -> None:
    for part in parts[:-1]:
        if not isinstance(root, dict):
            return
        root = root.get(part)
    if isinstance(root, dict):
        root.pop(parts[-1], None)
