"""``veil pate`` end to end: split, partition, teachers, private labels, student, report.

:class:`~veil.pate.config.PateConfig` holds every setting. :func:`run_pate` runs it and writes
``report.json``, ``report.html``, the plots, the released labels (``labels.npz``) and the student
(``student.model``) into the run folder, each file atomically.

The data (private part, public pool, test set) is prepared by :mod:`veil.pate.data`.

The run is charged to the dataset's privacy budget (``veil budget``): an exhausted dataset is refused
before a row is read; the most the labelling may spend is reserved (or the run refused) before the
private rows are read when the plan's shape is public, and always before any teacher is trained; the
released labels' (ε, δ) is what stays charged, the plan if the run stops first (:class:`_Account`).

A run folder whose labels were already released is refused: relabelling would draw fresh noise on
the same data and spend the budget a second time. Teachers are resumed (they are not private
releases).
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.errors import CheckpointError
from veil.pate.config import PateConfig, make_pate_config, resolve_pate_config
from veil.pate.data import PateData, load_pate_data, load_public_data, require_public_pool
from veil.pate.report import PateReport
from veil.pipeline.run_folder import check_out, default_out, write_files
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from veil.data import Dataset
    from veil.pate.aggregators import Aggregator
    from veil.pate.labelling import LabelResult, LabelSettings
    from veil.pate.partition import Partition
    from veil.pate.smooth_sensitivity import ReleaseParams
    from veil.pate.student import StudentResult
    from veil.pate.teachers import TeacherVotes

# The settings and the public-data reader live in veil.pate.config and veil.pate.data; their names
# stay importable from here, as before.
__all__ = ["PateConfig", "load_public_data", "make_pate_config", "resolve_pate_config", "run_pate"]


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()


# -- the run folder ---------------------------------------------------------------------------------
def _checked_out(cfg: PateConfig) -> Path:
    """The run folder (default ``runs/pate-<dataset>-<time>``), checked before any work. Refused if
    labels were released there; a folder holding only trained teachers (``teachers/``) is resumed."""
    out = Path(cfg.out) if cfg.out else default_out(cfg.dataset, "pate")
    if (out / "labels.npz").exists() or (out / "report.json").exists():
        raise CheckpointError(
            "out",
            str(out),
            "labels were already released from this run folder; labelling again would draw fresh noise on "
            "the same private data and spend the privacy budget a second time",
            "use the labels already released in this folder (labels.npz); labelling again elsewhere would "
            "spend the data's privacy budget a second time",
        )
    if not (out.is_dir() and {p.name for p in out.iterdir()} <= {"teachers"}):
        check_out(out)
    return out


# -- privacy settings (public parameters only) -----------------------------------------------------
def _release_params(cfg: PateConfig) -> ReleaseParams:
    from veil.pate.labelling import default_release_params
    from veil.pate.smooth_sensitivity import ReleaseParams

    base = default_release_params(cfg.epsilon, cfg.delta, cfg.dd_confidence)
    order = cfg.order if cfg.order is not None else base.order
    beta = cfg.smooth_beta if cfg.smooth_beta is not None else 0.25 * math.log1p(1.0 / (order - 1.0))
    sigma_s = cfg.smooth_sigma if cfg.smooth_sigma is not None else base.sigma_s
    return ReleaseParams(
        order=float(order), beta=float(beta), sigma_s=float(sigma_s), confidence=cfg.dd_confidence
    )


@dataclass(frozen=True)
class _Privacy:
    """The aggregator and the data-dependent release of a run, built from its settings."""

    cfg: PateConfig
    aggregator: Aggregator
    release: ReleaseParams | None

    def settings(self, max_queries: int, num_classes: int) -> LabelSettings:
        from veil.pate.labelling import LabelSettings

        cfg = self.cfg
        return LabelSettings(
            aggregator=self.aggregator,
            epsilon=cfg.epsilon,
            delta=cfg.delta,
            max_queries=max_queries,
            num_teachers=cfg.teachers,
            num_classes=num_classes,
            budget=cfg.budget,
            accountant=cfg.accountant,
            data_dependent=cfg.data_dependent,
            release=self.release,
            check_every=cfg.dd_check_every,
            ptr_test_share=cfg.ptr_test_share,
            ptr_select_share=cfg.ptr_select_share,
            ptr_order=cfg.ptr_order,
            ptr_max_answers=cfg.ptr_max_answers,
        )


def _privacy(cfg: PateConfig) -> _Privacy:
    """The privacy settings, checked before any work: the budget plan depends on public parameters
    only, so a budget too small for one query is refused before a teacher is trained."""
    from veil.pate.aggregators import make_aggregator
    from veil.pate.labelling import plan_budget

    agg = make_aggregator(cfg.aggregator, cfg.sigma, cfg.threshold, cfg.sigma1, cfg.teachers)
    uses_release = cfg.data_dependent and agg.has_data_dependent_analysis and cfg.budget != "ptr"
    privacy = _Privacy(cfg, agg, _release_params(cfg) if uses_release else None)
    plan_budget(privacy.settings(cfg.queries or 1, 2), cfg.secure_rng)
    return privacy


# -- teachers, labels, student ------------------------------------------------------------------------
def _partition(cfg: PateConfig, data: PateData, groups: Any) -> Partition:
    """One teacher per example (or group); δ ≥ 1/N over the protected units is refused, before any
    teacher is trained."""
    from veil.pate.partition import partition_teachers
    from veil.pipeline.data import check_delta

    ds = data.ds
    part = partition_teachers(ds.x_train, ds.y_train, cfg.teachers, seed=cfg.seed, groups=groups)
    check_delta(cfg.delta, part.num_units)
    return part


def _teacher_votes(
    cfg: PateConfig, data: PateData, part: Partition, out: Path, groups: Any, t_factory: Any
) -> TeacherVotes:
    """Train (or resume) the teachers on their partitions; their votes on the queries and test set."""
    from veil.pate.teachers import train_teachers
    from veil.progress import CountProgress, progress_enabled

    ds = data.ds
    x_q = data.x_queries
    fingerprint = _fingerprint(
        ds.sha256,
        part.assignment,
        x_q,
        data.x_test,
        repr(t_factory),
        cfg.teachers,
        cfg.seed,
        groups is not None,
    )
    with CountProgress(cfg.progress and progress_enabled(None), cfg.teachers, "teachers trained") as bar:
        votes = train_teachers(
            ds.x_train,
            ds.y_train,
            part.assignment,
            cfg.teachers,
            ds.num_classes,
            x_q,
            data.x_test,
            t_factory,
            run_dir=out,
            fingerprint=fingerprint,
            workers=cfg.workers,
            progress=bar.update,
        )
    return votes


def _label(cfg: PateConfig, privacy: _Privacy, hist: np.ndarray, out: Path, data: PateData) -> LabelResult:
    """Answer the queries within the budget and write the released labels (``labels.npz``)."""
    from veil.pate.labelling import label_queries
    from veil.pipeline.randomness import private_source

    settings = privacy.settings(len(data.order), data.ds.num_classes)
    # Every private draw (votes, threshold check, data-dependent release, PTR test) from one source:
    # the OS CSPRNG, or in research mode the seed derived for PATE_NOISE. Nothing of it is saved.
    rng = private_source(cfg.reproducible, cfg.seed, Purpose.PATE_NOISE)
    result = label_queries(hist, settings, rng)
    idx = np.flatnonzero(result.labels >= 0)
    buf = io.BytesIO()
    np.savez(buf, public_index=data.order[idx], label=result.labels[idx])
    write_files(out, {"labels.npz": buf.getvalue()})
    return result


def _student(
    cfg: PateConfig, data: PateData, result: LabelResult, out: Path, s_factory: Any
) -> StudentResult | None:
    """Train the student on public inputs and released labels only (the pool's true labels are never
    passed) and save it; None when a failed PTR test released nothing."""
    from veil.pate.student import train_student

    idx = np.flatnonzero(result.labels >= 0)
    if not idx.size and cfg.budget == "ptr":
        return None
    unlabelled = np.ones(len(data.x_pub), dtype=bool)
    unlabelled[data.order[idx]] = False
    student = train_student(
        data.x_queries[idx],
        result.labels[idx],
        data.x_test,
        data.y_test,
        s_factory,
        x_unlabelled=data.x_pub[unlabelled],
        semi_supervised=cfg.semi_supervised,
    )
    write_files(out, {"student.model": pickle.dumps(student.model, protocol=pickle.HIGHEST_PROTOCOL)})
    return student


# -- the report -----------------------------------------------------------------------------------------
def _release_info(cfg: PateConfig, privacy: _Privacy, result: LabelResult) -> dict[str, Any] | None:
    release = privacy.release
    if release is None:
        return None
    return {
        "order": release.order,
        "beta": release.beta,
        "sigma_s": release.sigma_s,
        "confidence": release.confidence,
        "releases": result.releases,
        "released_rdp": result.released_rdp,
        "release_rdp_each": result.release_rdp_per_release,
        "check_every": cfg.dd_check_every if cfg.budget == "data-dependent" else None,
    }


def _dataset_info(data: PateData) -> dict[str, Any]:
    ds = data.ds
    return {
        "name": ds.name,
        "sha256": ds.sha256,
        "num_classes": ds.num_classes,
        "n_private": len(ds.y_train),
        "n_public": len(data.x_pub),
        "n_test": len(data.y_test),
        "public_private_duplicates": int(data.duplicates),
        "split": data.split,
    }


def _files(student: StudentResult | None) -> dict[str, str]:
    files = {
        "report_json": "report.json",
        "report_html": "report.html",
        "labels": "labels.npz",
        "student": "student.model",
        "teachers": "teachers/",
        "epsilon_plot": "epsilon.png",
        "margins_plot": "margins.png",
    }
    if student is None:
        files.pop("student")
    return files


@dataclass(frozen=True)
class _Outcome:
    """What the run produced, as the report reads it."""

    privacy: _Privacy
    data: PateData
    part: Partition
    votes: TeacherVotes
    result: LabelResult
    student: StudentResult | None
    margins: np.ndarray
    models: tuple[str, str]
    started: float


def _margins(hist: np.ndarray, asked: int) -> np.ndarray:
    """Top vote count minus the second, per query asked."""
    srt = -np.sort(-hist[:asked], axis=1)
    return (srt[:, 0] - srt[:, 1]).astype(int) if asked else np.zeros(0, dtype=int)


def _build_report(cfg: PateConfig, o: _Outcome, out: Path) -> PateReport:
    import veil
    from veil.pate.report import guarantee_text, pate_checks
    from veil.pate.teachers import mean_accuracy
    from veil.pipeline.randomness import randomness_of, release_ready

    result, student, agg = o.result, o.student, o.privacy.aggregator
    idx = np.flatnonzero(result.labels >= 0)
    y_q = o.data.y_queries
    sizes, margins = o.part.sizes, o.margins
    rep = PateReport(
        epsilon=result.epsilon,
        guarantee="ptr" if cfg.budget == "ptr" else "data-independent",
        guarantee_statement="",
        epsilon_data_independent=result.epsilon_data_independent,
        epsilon_data_dependent=result.epsilon_data_dependent,
        delta=cfg.delta,
        target_epsilon=cfg.epsilon,
        budget=cfg.budget,
        privacy_unit=o.part.unit,
        accountant=agg.accountant_used(cfg.accountant),
        aggregator=agg.name,
        noise=agg.noise_settings(),
        data_dependent=_release_info(cfg, o.privacy, result),
        events={"answer": result.answer_event, "threshold_check": result.threshold_event},
        teachers=cfg.teachers,
        teacher_sizes={"min": float(sizes.min()), "max": float(sizes.max()), "mean": float(sizes.mean())},
        queries_planned=len(o.data.order),
        queries_asked=result.queries_asked,
        queries_answered=int(idx.size),
        stop_reason=result.stop_reason,
        label_accuracy=float(np.mean(result.labels[idx] == y_q[idx]))
        if (y_q is not None and idx.size)
        else None,
        teacher_accuracy=float(mean_accuracy(o.votes.test, o.data.y_test)),
        student_test_accuracy=student.test_accuracy if student is not None else None,
        student_train_size=student.train_size if student is not None else 0,
        student_semi_supervised=bool(student is not None and student.semi_supervised),
        student_pseudo_labels=student.pseudo_labelled if student is not None else 0,
        ptr=result.ptr,
        dataset=_dataset_info(o.data),
        teacher_model=o.models[0],
        student_model=o.models[1],
        seed=cfg.seed,
        reproducible=cfg.reproducible,
        randomness=randomness_of(cfg.reproducible),
        label_set={
            "source": "declared",
            "classes": list(o.data.ds.classes),
            "declared_by": o.data.ds.classes_declared_by,
        },
        teachers_resumed=o.votes.resumed,
        veil_version=veil.__version__,
        duration_s=time.time() - o.started,
        history={
            "epsilon_curve": [[float(a) for a in row] for row in result.epsilon_curve],
            "released_curve": [[float(a) for a in row] for row in result.released_curve],
        },
        vote_margins={
            "mean": float(margins.mean()) if margins.size else None,
            "histogram": np.bincount(margins, minlength=cfg.teachers + 1).tolist() if margins.size else [],
        },
        files=_files(student),
        out_dir=str(out),
    )
    checks = pate_checks(rep, o.part.num_units)
    return rep.model_copy(
        update={
            "guarantee_statement": guarantee_text(rep),
            "checks": checks,
            "release_ready": release_ready(rep.randomness, checks),
        }
    )


def _write_report(cfg: PateConfig, rep: PateReport, o: _Outcome, out: Path) -> None:
    """The plots, ``report.html`` and (last, marking the run complete) ``report.json``."""
    from veil.pate.report import epsilon_png, margins_png, render_html

    images = {
        "ε against queries answered": epsilon_png(
            rep.history["epsilon_curve"], rep.history["released_curve"], cfg.epsilon, cfg.delta
        ),
        "Vote margins": margins_png(o.margins.tolist(), (o.result.labels >= 0).tolist(), cfg.teachers),
    }
    files: dict[str, bytes | str] = {
        "epsilon.png": images["ε against queries answered"],
        "margins.png": images["Vote margins"],
        "report.html": render_html(rep, images),
        "report.json": rep.to_json(),  # last: marks the run complete
    }
    write_files(out, files)
    from veil.report.publish import publish

    released = {n: (out / n).read_bytes() for n in ("labels.npz", "student.model") if (out / n).is_file()}
    publish(out, rep.to_dict(), released)


def _factories(
    cfg: PateConfig, ds: Dataset, teacher_factory: Callable[[int], Any] | None, student_factory: Any
) -> tuple[Any, Any, tuple[str, str]]:
    """The teacher and student factories (configured recipes unless given) and their report names."""
    from veil.pate.teachers import ModelRecipe

    def recipe(spec: str, seed: int) -> ModelRecipe:
        return ModelRecipe(spec, ds.input_shape, ds.num_classes, ds.kind, ds.pixel_max, seed, cfg.epochs)

    t_factory = teacher_factory or recipe(cfg.teacher_model, cfg.seed)
    s_factory = student_factory or recipe(cfg.student_model, derive_seed(cfg.seed, Purpose.PATE_STUDENT))
    names = (
        repr(t_factory) if teacher_factory else cfg.teacher_model,
        repr(s_factory) if student_factory else cfg.student_model,
    )
    return t_factory, s_factory, names


def run_pate(
    config: PateConfig | Mapping[str, Any] | None = None,
    *,
    groups: Sequence[object] | np.ndarray | None = None,
    teacher_factory: Callable[[int], Any] | None = None,
    student_factory: Callable[[int], Any] | None = None,
) -> PateReport:
    """Run PATE end to end and write the report (see the module docstring).

    ``groups``: one group id per private example (the unit of privacy becomes the group).
    ``teacher_factory``/``student_factory``: ``factory(index) -> estimator`` with ``fit``/``predict``,
    instead of the configured model names (must be picklable when ``workers > 1``).
    """
    started = time.time()
    cfg = config if isinstance(config, PateConfig) else make_pate_config(config or {})
    out = _checked_out(cfg)
    privacy = _privacy(cfg)  # settings errors before any work
    require_public_pool(cfg)  # the pool is declared public: refused before a row is read
    account = _Account.before_reading(cfg)  # an exhausted dataset is refused before a row is read
    try:
        shape = _plan_shape(cfg)  # (queries, classes) known from public facts: charge before reading
        if shape is not None:
            account.reserve(privacy, *shape)
        data = load_pate_data(cfg)
        t_factory, s_factory, models = _factories(cfg, data.ds, teacher_factory, student_factory)
        part = _partition(cfg, data, groups)
        if shape is None:  # a built-in benchmark: the pool's size is its public split's
            account.reserve(privacy, len(data.order), data.ds.num_classes)
        elif shape != (len(data.order), data.ds.num_classes):  # pragma: no cover - same public facts
            raise RuntimeError(f"the plan {shape} does not match the loaded data")
        votes = _teacher_votes(cfg, data, part, out, groups, t_factory)
        hist = votes.histograms(data.ds.num_classes)
        result = _label(cfg, privacy, hist, out, data)
        account.released = result
        student = _student(cfg, data, result, out, s_factory)
        margins = _margins(hist, result.queries_asked)
        outcome = _Outcome(privacy, data, part, votes, result, student, margins, models, started)
        rep = _build_report(cfg, outcome, out)
        rep.dataset_budget = account.budget_section(out)
        _write_report(cfg, rep, outcome, out)
    finally:
        account.settle()
    return rep


def _plan_shape(cfg: PateConfig) -> tuple[int, int] | None:
    """(queries, classes) of the plan from public facts alone — the declared public pool's size and the
    declared label set — or ``None`` when they come with the data (a built-in benchmark)."""
    if cfg.public_data is None or cfg.classes is None:
        return None
    pool = len(load_public_data(cfg.public_data)[0])
    return min(cfg.queries or pool, pool), len(cfg.classes)


class _Account:
    """The run's charge to the privacy-budget registry (``veil budget``), as one
    :class:`~veil.accounting.events.ApproximateDP` event at the run's δ: PATE's guarantee is an (ε, δ)
    statement (PTR, data-dependent stopping), not a composition of events. Reserved before a private row
    is read when the plan's shape is public (``--public-data`` and ``--classes``: :func:`_plan_shape`),
    else (a built-in benchmark, whose public split sets the pool) once the data is loaded; always before
    any teacher is trained: the most ε the budget allows (:func:`veil.pate.labelling.planned_epsilon`).
    Settled to the released labels' guarantee; a run that stops before releasing a label stays charged
    with its plan (:class:`veil.pipeline.private_data.PrivateAccount`)."""

    def __init__(self, cfg: PateConfig, charge: Any) -> None:
        self.cfg = cfg
        self.charge = charge
        self.released: LabelResult | None = None

    @classmethod
    def before_reading(cls, cfg: PateConfig) -> _Account:
        from veil.pipeline.private_data import data_ref, open_account

        return cls(cfg, open_account(data_ref(cfg.dataset, cfg), job="pate"))

    def reserve(self, privacy: _Privacy, queries: int, num_classes: int) -> None:
        """Reserve the plan; from here the private rows are (being) read, so the charge stands."""
        import uuid

        from veil.accounting.events import ApproximateDP
        from veil.pate.labelling import plan_budget, planned_epsilon

        settings = privacy.settings(queries, num_classes)
        planned = planned_epsilon(settings, plan_budget(settings, True, queries))
        self.charge.reserve([ApproximateDP(planned, self.cfg.delta)], uuid.uuid4().hex, self.cfg.delta)
        self.charge.reading()

    def budget_section(self, out: Path) -> dict[str, Any] | None:
        """The report's ``dataset_budget``: this run counted with what it released."""
        from veil.accounting.events import ApproximateDP

        released = self.released
        events = None if released is None else [ApproximateDP(released.epsilon, self.cfg.delta)]
        return self.charge.budget_section(events, out) if self.charge.run_id is not None else None

    def settle(self) -> None:
        from veil.accounting.events import ApproximateDP

        released = self.released
        self.charge.finish(None if released is None else [ApproximateDP(released.epsilon, self.cfg.delta)])
