"""``veil pate`` end to end: split, partition, teachers, private labels, student, report.

:class:`~veil.pate.config.PateConfig` holds every setting. :func:`run_pate` runs it and writes
``report.json``, ``report.html``, the plots, the released labels (``labels.npz``) and the student
(``student.model``) into the run folder, each file atomically.

The data (private part, public pool, test set) is prepared by :mod:`veil.pate.data`.

The run is charged to the dataset's privacy budget (``veil budget``): an exhausted dataset is refused
before a row is read; the most the labelling may spend is reserved (or the run refused) before the
private rows are read when the plan's shape is public, and always before any teacher is trained; the
released labels' (ε, δ) is what stays charged, the plan if the run stops first
(:class:`veil.pate.account.PateAccount`). The report is built and written by :mod:`veil.pate.outcome`.

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

from veil.data import check_request
from veil.errors import CheckpointError
from veil.pate.account import PateAccount, plan_shape
from veil.pate.config import PateConfig, make_pate_config, resolve_pate_config
from veil.pate.data import PateData, load_pate_data, load_public_data, require_public_pool
from veil.pate.outcome import Outcome, build_report, margins_of, write_report
from veil.pate.report import PateReport
from veil.pipeline.run_folder import check_out, default_out, write_files
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from veil.data import Dataset
    from veil.pate.aggregators import Aggregator
    from veil.pate.label_settings import LabelResult, LabelSettings
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
    from veil.pate.label_settings import default_release_params
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
        from veil.pate.label_settings import LabelSettings

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
    """Each example (or group) to one teacher by a keyed hash of the record alone.

    N (the examples or groups protected) is private for PATE and the rows are read by now: δ against
    1/N is a note in the internal report (:func:`veil.pipeline.data.delta_note`), never a refusal or
    a message, which would let one record decide whether labels are released. The one exception is a
    built-in benchmark read from the files veil ships or knows (no ``--data-dir``): its split is a
    fixed, documented dataset, so δ ≥ 1/N is refused there on public facts. With ``--data-dir`` a
    built-in name reads the user's own files, whose count is private: a note (revI I2). N = 0 (the
    keyed split holding every row out) is partitioned like any N: every teacher abstains and the
    aggregator still answers, charged and released as planned (:mod:`veil.pate.partition`)."""
    from veil.data import BUILTIN
    from veil.pate.partition import partition_teachers
    from veil.pipeline.data import check_delta

    ds = data.ds
    if cfg.dataset in BUILTIN and cfg.data_dir is None and groups is None:
        check_delta(cfg.delta, len(ds.y_train))
    return partition_teachers(ds.x_train, ds.y_train, cfg.teachers, seed=cfg.seed, groups=groups)


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
    passed) and save it; None when no label was released (a failed PTR test, or no query answered):
    a rule on the released labels, never a refusal once they are released and charged."""
    from veil.pate.student import train_student

    idx = np.flatnonzero(result.labels >= 0)
    if not idx.size:
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
    check_request(cfg.dataset, target=cfg.target, classes=cfg.classes)  # public mistakes: free
    account = PateAccount.before_reading(cfg)  # an exhausted dataset is refused before a row is read
    try:
        shape = plan_shape(cfg)  # (queries, classes) known from public facts: charge before reading
        if shape is not None:
            account.reserve(privacy.settings(*shape))
        data = load_pate_data(cfg)
        t_factory, s_factory, models = _factories(cfg, data.ds, teacher_factory, student_factory)
        part = _partition(cfg, data, groups)
        if shape is None:  # a built-in benchmark: the pool's size is its public split's
            account.reserve(privacy.settings(len(data.order), data.ds.num_classes))
        elif shape != (len(data.order), data.ds.num_classes):  # pragma: no cover - same public facts
            raise RuntimeError(f"the plan {shape} does not match the loaded data")
        votes = _teacher_votes(cfg, data, part, out, groups, t_factory)
        hist = votes.histograms(data.ds.num_classes)
        result = _label(cfg, privacy, hist, out, data)
        account.released = result
        student = _student(cfg, data, result, out, s_factory)
        margins = margins_of(hist, result.queries_asked)
        outcome = Outcome(
            privacy.aggregator, privacy.release, data, part, votes, result, student, margins, models, started
        )
        rep = build_report(cfg, outcome, out)
        rep.dataset_budget = account.budget_section(out)
        write_report(cfg, rep, outcome, out)
    finally:
        account.settle()
    return rep
