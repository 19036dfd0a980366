"""The PATE run report: ``report.json`` (stable field names), ``report.html`` and two PNG plots.

Field names are part of veil's interface: new fields may be added, existing ones keep their name
and meaning. ``report.json`` follows the common report schema (:mod:`veil.report.schema`): the
``guarantee`` object, ``dataset_budget``, ``summary``, ``files``, the ``pate`` section (its former
top-level keys repeated there as deprecated aliases for one release; the former ``guarantee`` string
is ``pate.guarantee``). Figures computed from private data without privacy (label, teacher and student
accuracy, the vote margins, the teachers' partition sizes, the private row count and the
public/private duplicate count) sit only in the ``non_private`` section (:data:`NON_PRIVATE`); the
Python attributes keep their names. ``release_ready``: secure randomness and every check passed.
``epsilon`` is always the ε of the stated guarantee (``guarantee``); both analyses are
reported next to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from veil.pipeline.outputs import finite
from veil.report import Check
from veil.report.plots import figure, png_bytes

__all__ = [
    "NON_PRIVATE",
    "PateReport",
    "epsilon_png",
    "guarantee_text",
    "margins_png",
    "pate_checks",
    "render_html",
]


NON_PRIVATE = (
    "label_accuracy",
    "teacher_accuracy",
    "student_test_accuracy",
    "vote_margins",
    "teacher_sizes",
    "checks_on_n",
)
"""Fields computed on private data without privacy: written under ``non_private`` in report.json."""

_NON_PRIVATE_DATASET = ("n_private", "n_test", "public_private_duplicates", "sha256")
"""``dataset`` fields counted or hashed from the private data without noise: in ``non_private``."""

_RELEASED = ("queries_answered", "stop_reason", "data_dependent", "epsilon_data_dependent", "ptr", "history")
"""Fields that depend on the private votes, released under the run's guarantee (its charged event)."""

_FILES = {
    "report.json": ("this report, machine-readable (the full internal one)", False, False),
    "report.html": ("this report as a page (the full internal one)", False, False),
    "labels.npz": ("the released labels (public indices and labels)", True, False),
    "student.model": ("the student model (pickled), trained on the released labels only", True, False),
    "teachers/": ("the teachers and their votes, trained without noise on private partitions", False, True),
    "epsilon.png": ("ε against queries answered", False, False),
    "margins.png": ("vote margins of the teachers", False, True),
    "release": ("what the guarantee covers, publishable as is: labels, student, public report", False, False),
}

_NON_PRIVATE_NOTE = (
    "computed on private data (teachers' votes, held-out labels) without privacy: keep internal, "
    "not covered by the guarantee"
)


class PateReport(BaseModel):
    """Everything to file about one ``veil pate`` run."""

    model_config = ConfigDict(extra="forbid")

    # The guarantee.
    epsilon: float
    guarantee: str
    guarantee_statement: str
    epsilon_data_independent: float
    epsilon_data_dependent: float | None
    delta: float
    target_epsilon: float
    budget: str
    neighbouring: str = "add_or_remove_one"
    privacy_unit: str
    accountant: str
    # The mechanism.
    aggregator: str
    noise: dict[str, float | None]
    data_dependent: dict[str, Any] | None
    events: dict[str, Any]
    teachers: int
    teacher_sizes: dict[str, float]
    queries_planned: int
    queries_asked: int
    queries_answered: int
    stop_reason: str
    # Utility (diagnostics computed without privacy).
    label_accuracy: float | None
    teacher_accuracy: float
    checks_on_n: list[str] = Field(default_factory=list)
    """Notes on the exact private N (δ against 1/N: :func:`veil.pipeline.data.delta_note`), internal
    only: N is private for PATE, so it is never a refusal, a check or a message."""
    student_test_accuracy: float | None
    """None when no student was trained (a failed PTR test releases no label)."""
    student_train_size: int
    student_semi_supervised: bool = False
    """Whether the student was also self-trained on the unlabelled public pool (no privacy cost)."""
    student_pseudo_labels: int = 0
    ptr: dict[str, Any] | None = None
    """PTR budget: the public plan (ε/δ split, λ, B, τ), the selection size and the test outcome."""
    # Data and models.
    dataset: dict[str, Any]
    teacher_model: str
    student_model: str
    # Reproducibility and audit.
    seed: int
    reproducible: bool
    randomness: str
    """``secure`` (OS CSPRNG, the default) or ``seeded`` (research mode, never release-ready)."""
    label_set: dict[str, Any]
    """The public label set: ``source`` (declared), ``classes``, ``declared_by``."""
    release_ready: bool = False
    teachers_resumed: int
    veil_version: str
    duration_s: float
    history: dict[str, list[list[float]]]
    vote_margins: dict[str, Any]
    files: dict[str, str]
    out_dir: str
    checks: list[Check] = Field(default_factory=list)
    """The verification checklist, each item recomputed from what the run did."""
    dataset_budget: dict[str, Any] | None = None
    """The dataset's budget and composed spend from the registry (the report's ``dataset_budget``)."""

    @property
    def secure_rng(self) -> bool:
        """Noise from the OS CSPRNG (the name older code reads)."""
        return not self.reproducible

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the content of ``report.json``) in the common report schema, the
        non-private figures only in ``non_private``."""
        from veil.accounting.events import ApproximateDP
        from veil.report.publish import plain_summary
        from veil.report.schema import Evidence, Guarantee, ReportBuilder

        out = dict(finite(self.model_dump(mode="json")))
        budget = out.pop("dataset_budget")
        non_private = {k: out.pop(k) for k in NON_PRIVATE}
        dataset = out.pop("dataset")
        non_private["dataset"] = {k: dataset.pop(k) for k in _NON_PRIVATE_DATASET if k in dataset}
        evidence = Evidence.of(
            "the run's charge in the budget registry", [ApproximateDP(self.epsilon, self.delta)]
        )
        guarantee = Guarantee(
            epsilon=self.epsilon,
            delta=self.delta,
            unit="group" if self.privacy_unit == "group" else "row",
            neighbouring=self.neighbouring,
            accountant=self.accountant,
            covers="the released labels (labels.npz) and the student model trained on them (post-processing);"
            " "
            "not the teachers, their votes or any accuracy",
            randomness="seeded" if self.reproducible else "secure",
            release_ready=self.release_ready,
            statement=self.guarantee_statement,
            evidence=evidence,
            extra={
                "analysis": self.guarantee,
                "target_epsilon": self.target_epsilon,
                "epsilon_data_independent": self.epsilon_data_independent,
                "epsilon_data_dependent": self.epsilon_data_dependent,
            },
        )
        b = ReportBuilder("pate", guarantee)
        b.non_private_fields(
            {"note": _NON_PRIVATE_NOTE, "test_accuracy": non_private["student_test_accuracy"], **non_private}
        )
        checks = out.pop("checks")
        out.pop("files")
        for key in _RELEASED:
            b.released(key, out.pop(key), evidence)
        b.public_fields({**out, "dataset": dataset, "files": dict(self.files)})
        for name, (what, release, internal) in _FILES.items():
            if name != "student.model" or "student" in self.files:
                b.file(name, what, release=release, non_private=internal)
        b.release_file("report.json").release_file("report.html").checks(checks)
        b.dataset_budget = budget
        b.summary = plain_summary(guarantee.to_dict(), budget, "the released labels or the student model")
        return b.build()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"


def _ptr_text(r: PateReport, unit: str, released: str) -> str:
    p = r.ptr or {}
    outcome = (
        f"the test passed and {r.queries_answered} labels were released"
        if p.get("passed")
        else "the test failed and no label was released (the ε is spent all the same)"
    )
    return (
        f"Guarantee (Propose-Test-Release): {released} and the pass/fail outcome of the test are "
        f"({r.epsilon:.4g}, {r.delta:g})-differentially private with respect to each {unit}, whatever the "
        f"data: ε = {p.get('eps_select', 0.0):.3g} (selection, data-independent) + "
        f"{p.get('eps_test', 0.0):.3g} (private test that the data is far from any dataset whose "
        f"data-dependent Rényi cost at order {p.get('order')} exceeds {p.get('bound', 0.0):.4g}) + "
        f"{p.get('eps_release', 0.0):.3g} (the labels, bounded by that cost). In this run {outcome}. "
        f"For comparison, the data-independent analysis of the same release gives "
        f"ε = {r.epsilon_data_independent:.4g}."
    )


def guarantee_text(r: PateReport) -> str:
    """The guarantee in plain words (also stored as ``guarantee_statement``); in research mode it
    ends with the research caveat (the noise can be recomputed from the seed)."""
    text = _guarantee_text(r)
    return text + " " + _research_sentence() if r.reproducible else text


def _guarantee_text(r: PateReport) -> str:
    unit = "group (as given by the group ids)" if r.privacy_unit == "group" else "private training example"
    released = "the labels released for the student (hence the student model, by post-processing)"
    if r.guarantee == "ptr":
        return _ptr_text(r, unit, released)
    if r.epsilon_data_dependent is not None:
        released += " and the released data-dependent privacy cost"
    di = (
        f"Unconditional guarantee: {released} are ({r.epsilon_data_independent:.4g}, {r.delta:g})-"
        f"differentially private with respect to each {unit}: adding or removing one changes the "
        f"probability of any outcome by at most a factor e^{r.epsilon_data_independent:.4g}, except with "
        f"probability {r.delta:g}, whatever the data (data-independent analysis of the {r.aggregator} "
        "aggregator, every query asked and every release included)."
    )
    if r.epsilon_data_dependent is None:
        return di
    dd = r.data_dependent or {}
    conf = dd.get("confidence", 0.95)
    ddtext = (
        f" Data-dependent (per-instance) bound: with probability {conf:g} over the release noise, for this "
        f"particular private dataset and every dataset differing from it in one {unit}, the probability of "
        f"any outcome is at most e^{r.epsilon_data_dependent:.4g} times larger on this dataset than on the "
        f"other, plus {r.delta:g} (Papernot et al. 2018, Rényi order {dd.get('order')}, released through "
        "smooth sensitivity, the release itself paid for). It is not a guarantee for every dataset."
    )
    if r.budget == "data-dependent":
        return (
            f"The budget of this run was the data-dependent ε. {ddtext.strip()} The guarantee that holds "
            f"for every dataset is the data-independent ε = {r.epsilon_data_independent:.4g}: " + di
        )
    return di + ddtext


def pate_checks(r: PateReport) -> list[Check]:
    """The checklist: the ε that stopped the run (the guarantee's, or the released data-dependent one)
    within the target, and the randomness. No check on N: the number of protected units is private
    for PATE, and a check's detail (and ``release_ready``, which every check gates) is public; δ
    against 1/N is the internal note ``checks_on_n``."""
    from veil.pipeline.randomness import randomness_check

    if r.budget == "data-dependent":
        eps, what = r.epsilon_data_dependent, "the released data-dependent ε (this run's budget)"
    else:
        eps, what = r.epsilon, f"the ε of the {r.guarantee} guarantee"
    kept = eps is not None and eps <= r.target_epsilon * (1.0 + 1e-9)
    shown = "not released" if eps is None else f"{eps:.4g}"
    return [
        Check(
            name="target_epsilon_kept",
            passed=bool(kept),
            detail=f"{what} = {shown}, target {r.target_epsilon:g}",
        ),
        randomness_check(r.randomness),
    ]


def _caveats(r: PateReport) -> list[str]:
    out = [
        "Label accuracy, teacher accuracy, the vote margins and the student's test accuracy are "
        "diagnostics computed on private data without privacy: keep this report internal; release the "
        "student model (and, if wanted, the ε values) only.",
        "Teachers are trained without privacy on disjoint partitions; their weights and votes (saved in "
        "the run folder) are as sensitive as the private data.",
    ]
    if r.reproducible:
        out.append(_research_sentence() + " Run without --reproducible for labels that are to be released.")
    return out


def _research_sentence() -> str:
    from veil.pipeline.randomness import RESEARCH_CAVEAT

    return f"{RESEARCH_CAVEAT[0].upper()}{RESEARCH_CAVEAT[1:]}: not release-ready."


def epsilon_png(
    curve: Sequence[Sequence[float]], released: Sequence[Sequence[float]], target: float, delta: float
) -> bytes:
    """ε against queries answered: the data-independent cost of the path, and released values."""
    plt, fig = figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    if curve:
        ax.plot([c[0] for c in curve], [c[2] for c in curve], marker=".", label="data-independent (path)")
    if released:
        ax.plot(
            [c[0] for c in released],
            [c[2] for c in released],
            "s",
            color="tab:green",
            label="released data-dependent",
        )
    ax.axhline(target, linestyle="--", color="tab:red", label=f"target ε = {target:g}")
    ax.set_xlabel("queries answered")
    ax.set_ylabel(f"ε (δ = {delta:g})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Privacy spent while labelling")
    return png_bytes(plt, fig)


def margins_png(margins: Sequence[int], answered: Sequence[bool], num_teachers: int) -> bytes:
    """Histogram of vote margins (top count − second count), answered vs not answered."""
    plt, fig = figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    bins = min(50, num_teachers + 1)
    yes = [m for m, a in zip(margins, answered, strict=True) if a]
    no = [m for m, a in zip(margins, answered, strict=True) if not a]
    ax.hist([yes, no], bins=bins, range=(0, num_teachers), stacked=True, label=["answered", "not answered"])
    ax.set_xlabel(f"vote margin (top − second, of {num_teachers} teachers)")
    ax.set_ylabel("queries")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Teacher consensus on the queries asked")
    return png_bytes(plt, fig)


def render_html(r: PateReport, images: Mapping[str, bytes]) -> str:
    """The report page (``veil/report/templates/pate.html.j2``, the skeleton every job's page shares);
    ``images`` maps a title to PNG bytes (embedded, no external assets)."""
    from veil.report.render import render_page

    return render_page(
        "pate.html.j2",
        images,
        r=r,
        caveats=_caveats(r),
        checks=r.checks,
        files=r.to_dict()["files"],
        summary=r.to_dict()["summary"],
        dataset_budget=r.dataset_budget,
    )
