"""What a PATE run produced (:class:`Outcome`) and the report built from it, then written.

:func:`build_report` turns the outcome into a :class:`~veil.pate.report.PateReport` (the guarantee,
the plan, the non-private evaluation figures) with its checks; :func:`write_report` writes the plots,
``report.html`` and, last (it marks the run complete), ``report.json``, then publishes the released
files. Nothing here touches private data beyond what the outcome already holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.pate.config import PateConfig
from veil.pate.data import PateData
from veil.pate.report import PateReport
from veil.pipeline.run_folder import write_files

if TYPE_CHECKING:
    from veil.pate.aggregators import Aggregator
    from veil.pate.label_settings import LabelResult
    from veil.pate.partition import Partition
    from veil.pate.smooth_sensitivity import ReleaseParams
    from veil.pate.student import StudentResult
    from veil.pate.teachers import TeacherVotes

__all__ = ["Outcome", "build_report", "margins_of", "write_report"]


def _release_info(
    cfg: PateConfig, release: ReleaseParams | None, result: LabelResult
) -> dict[str, Any] | None:
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
class Outcome:
    """What the run produced, as the report reads it."""

    aggregator: Aggregator
    release: ReleaseParams | None
    data: PateData
    part: Partition
    votes: TeacherVotes
    result: LabelResult
    student: StudentResult | None
    margins: np.ndarray
    models: tuple[str, str]
    started: float


def margins_of(hist: np.ndarray, asked: int) -> np.ndarray:
    """Top vote count minus the second, per query asked."""
    srt = -np.sort(-hist[:asked], axis=1)
    return (srt[:, 0] - srt[:, 1]).astype(int) if asked else np.zeros(0, dtype=int)


def build_report(cfg: PateConfig, o: Outcome, out: Path) -> PateReport:
    import veil
    from veil.pate.report import guarantee_text, pate_checks
    from veil.pate.teachers import mean_accuracy
    from veil.pipeline.data import delta_note
    from veil.pipeline.randomness import randomness_of, release_ready

    result, student, agg = o.result, o.student, o.aggregator
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
        data_dependent=_release_info(cfg, o.release, result),
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
        checks_on_n=[n for n in [delta_note(cfg.delta, o.part.num_units)] if n is not None],
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
    checks = pate_checks(rep)
    return rep.model_copy(
        update={
            "guarantee_statement": guarantee_text(rep),
            "checks": checks,
            "release_ready": release_ready(rep.randomness, checks),
        }
    )


def write_report(cfg: PateConfig, rep: PateReport, o: Outcome, out: Path) -> None:
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
