"""``veil pate`` end to end: split, partition, teachers, private labels, student, report.

:class:`PateConfig` holds every setting (defaults < TOML file < flags, unknown keys refused by
name). :func:`run_pate` runs it and writes ``report.json``, ``report.html``, the plots, the
released labels (``labels.npz``) and the student (``student.model``) into the run folder.

Data. A built-in or user dataset is loaded by :func:`veil.data.load_dataset`; its training part
is the private data (teachers). Its held-out part is split, fixed by ``seed`` and stratified, into
the public pool (the student's unlabelled queries, ``public_fraction``) and the test set — unless
``public_data`` names a file of public examples, which must share no row with the private data.

A run folder whose labels were already released is refused: relabelling would draw fresh noise on
the same data and spend the budget a second time. Teachers are resumed (they are not private
releases).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from veil.errors import CheckpointError, ConfigError, DataError
from veil.pate.report import PateReport

__all__ = ["PateConfig", "load_public_data", "make_pate_config", "resolve_pate_config", "run_pate"]


class PateConfig(BaseModel):
    """Every setting of a ``veil pate`` run, with its default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- data ------------------------------------------------------------------------------------
    dataset: str = "digits"
    data_dir: str | None = None
    target: str | None = None
    public_data: str | None = None
    """An ``.npz`` (array ``x``, optional ``y``) or ``.npy`` file of public examples."""
    holdout_fraction: float = 0.4
    """Share held out from the private data (datasets without a fixed test split)."""
    public_fraction: float = 0.5
    """Share of the held-out examples that form the public pool (the rest: test)."""
    # -- teachers and student -------------------------------------------------------------------
    teachers: int = 50
    teacher_model: str = "sklearn-logreg"
    student_model: str = "sklearn-logreg"
    epochs: int = 20
    """Epochs of the torch models (teachers and student)."""
    workers: int = 1
    # -- privacy --------------------------------------------------------------------------------
    aggregator: Literal["lnmax", "gnmax", "confident-gnmax"] = "gnmax"
    epsilon: float = 2.0
    delta: float = 1e-5
    queries: int | None = None
    """Largest number of queries asked (default: the whole public pool)."""
    sigma: float | None = None
    """GNMax σ / Confident-GNMax σ₂ (default 0.16·K) or LNMax scale b (default 0.08·K), in votes."""
    threshold: float | None = None
    """Confident-GNMax threshold T (default 0.8·K)."""
    sigma1: float | None = None
    """Confident-GNMax threshold noise σ₁ (default 0.6·K)."""
    budget: Literal["data-independent", "data-dependent", "ptr"] = "data-independent"
    """Which ε stops the run; ``ptr``: Propose-Test-Release makes the data-dependent bound a guarantee."""
    accountant: Literal["pld", "rdp"] = "pld"
    """Accountant of LNMax; the Gaussian aggregators are accounted in RDP."""
    data_dependent: bool = True
    """Compute and privately release the data-dependent ε (GNMax, Confident-GNMax)."""
    order: float | None = None
    smooth_beta: float | None = None
    smooth_sigma: float | None = None
    dd_confidence: float = 0.95
    dd_check_every: int = 50
    ptr_test_share: float = 0.1
    ptr_select_share: float = 0.3
    ptr_order: float | None = None
    ptr_max_answers: int | None = None
    semi_supervised: bool = True
    """Self-train the student on the unlabelled public pool (post-processing: no privacy cost)."""
    # -- run --------------------------------------------------------------------------------------
    seed: int = 0
    secure_rng: bool = False
    out: str | None = None
    progress: bool = False

    @field_validator("teachers", "epochs", "workers", "dd_check_every")
    @classmethod
    def _positive_int(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be ≥ 1")
        return v

    @field_validator("queries", "ptr_max_answers")
    @classmethod
    def _queries(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("queries must be ≥ 1")
        return v

    @field_validator("holdout_fraction", "public_fraction")
    @classmethod
    def _fraction(cls, v: float, info: Any) -> float:
        if not (0 < v < 1):
            raise ValueError(f"{info.field_name} must lie in (0, 1)")
        return v


_KEYS = tuple(PateConfig.model_fields)


def _normalise(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        k = str(key).replace("-", "_")
        if k not in _KEYS:
            close = difflib.get_close_matches(k, _KEYS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                key,
                value,
                f"unknown {source} setting; a typo must not silently fall back to a default privacy setting",
                f"{hint}use one of {', '.join(_KEYS)}",
            )
        out[k] = value
    return out


def make_pate_config(values: Mapping[str, Any] | None = None, source: str = "config") -> PateConfig:
    """A validated :class:`PateConfig`; bad keys and values are refused with the key named."""
    clean = _normalise(values or {}, source)
    from veil.pate.aggregators import AGGREGATORS

    if "aggregator" in clean and clean["aggregator"] not in AGGREGATORS:
        raise ConfigError(
            "aggregator",
            clean["aggregator"],
            "only LNMax, GNMax and Confident-GNMax have a privacy analysis here",
            f"use one of {', '.join(AGGREGATORS)}",
        )
    if "budget" in clean and clean["budget"] not in ("data-independent", "data-dependent", "ptr"):
        raise ConfigError(
            "budget",
            clean["budget"],
            "the budget says which ε stops the run",
            "use data-independent (a worst-case guarantee), data-dependent, or ptr (Propose-Test-Release)",
        )
    try:
        return PateConfig(**clean)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err.get("loc", ())) or "config"
        raise ConfigError(
            key, clean.get(key, err.get("input")), str(err.get("msg", "invalid value")), "fix this setting"
        ) from None


def resolve_pate_config(
    config_file: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PateConfig:
    """Defaults < ``config_file`` (a ``[pate]`` table or top-level keys) < ``overrides`` (None: unset)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        from veil.config import load_config_file

        data = load_config_file(config_file)
        if isinstance(data.get("pate"), dict) and len(data) == 1:
            data = data["pate"]
        merged.update(_normalise(data, "config file"))
    if overrides:
        merged.update(_normalise({k: v for k, v in overrides.items() if v is not None}, "flag"))
    return make_pate_config(merged)


def load_public_data(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Public examples from ``.npz`` (``x``, optional ``y``) or ``.npy``."""
    p = Path(path)
    if not p.is_file():
        raise DataError("public_data", str(p), "the file does not exist", "pass an .npz or .npy file")
    try:
        if p.suffix == ".npy":
            return np.asarray(np.load(p, allow_pickle=False)), None
        with np.load(p, allow_pickle=False) as z:
            if "x" not in z:
                raise DataError(
                    "public_data", str(p), f"no array named 'x' (found {sorted(z.files)})", "save it as x="
                )
            return np.asarray(z["x"]), (np.asarray(z["y"]) if "y" in z else None)
    except (OSError, ValueError) as exc:
        raise DataError(
            "public_data", str(p), f"not a readable numpy file ({exc})", "pass .npz/.npy"
        ) from None


def _child_seed(seed: int, purpose: str) -> int:
    return int.from_bytes(hashlib.sha256(f"veil-pate:{seed}:{purpose}".encode()).digest()[:8], "little") >> 1


def _split_holdout(
    x: np.ndarray, y: np.ndarray, public_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    n = len(y)
    n_pub = round(public_fraction * n)
    if n_pub < 1 or n - n_pub < 1:
        raise DataError(
            "public_fraction",
            public_fraction,
            f"the {n} held-out examples leave no public pool or no test set",
            "use more data or a different public_fraction",
        )
    counts = np.bincount(y)
    strat = y if counts[counts > 0].min() >= 2 and min(n_pub, n - n_pub) >= len(counts) else None
    i_pub, i_test = train_test_split(
        np.arange(n), train_size=n_pub, random_state=_child_seed(seed, "holdout") % 2**32, stratify=strat
    )
    return x[i_pub], y[i_pub], x[i_test], y[i_test]


def _default_out(cfg: PateConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.dataset.replace(":", "-").replace("/", "_")[-40:]
    return Path("runs") / f"pate-{name}-{stamp}"


def _aggregator(cfg: PateConfig, k: int) -> Any:
    from veil.pate.aggregators import make_aggregator

    return make_aggregator(cfg.aggregator, cfg.sigma, cfg.threshold, cfg.sigma1, k)


def _old_aggregator(cfg: PateConfig, k: int) -> Any:
    from veil.pate.aggregators import Aggregator

    if cfg.aggregator == "lnmax":
        return Aggregator("lnmax", cfg.sigma if cfg.sigma is not None else 0.08 * k)
    if cfg.aggregator == "gnmax":
        return Aggregator("gnmax", cfg.sigma if cfg.sigma is not None else 0.16 * k)
    return Aggregator(
        "confident-gnmax",
        cfg.sigma if cfg.sigma is not None else 0.16 * k,
        threshold=cfg.threshold if cfg.threshold is not None else 0.8 * k,
        sigma1=cfg.sigma1 if cfg.sigma1 is not None else 0.6 * k,
    )


def _release_params(cfg: PateConfig) -> Any:
    from veil.pate.labelling import default_release_params
    from veil.pate.smooth_sensitivity import ReleaseParams

    base = default_release_params(cfg.epsilon, cfg.delta, cfg.dd_confidence)
    order = cfg.order if cfg.order is not None else base.order
    beta = cfg.smooth_beta if cfg.smooth_beta is not None else 0.25 * math.log1p(1.0 / (order - 1.0))
    sigma_s = cfg.smooth_sigma if cfg.smooth_sigma is not None else base.sigma_s
    return ReleaseParams(
        order=float(order), beta=float(beta), sigma_s=float(sigma_s), confidence=cfg.dd_confidence
    )


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
    t0 = time.time()
    cfg = config if isinstance(config, PateConfig) else make_pate_config(config or {})
    import veil
    from veil.data import load_dataset
    from veil.mechanisms import make_source
    from veil.pate.labelling import LabelSettings, label_queries, plan_budget
    from veil.pate.partition import check_public_disjoint, partition_teachers, row_digests
    from veil.pate.report import epsilon_png, finite_or_none, guarantee_text, margins_png, render_html
    from veil.pate.student import train_student
    from veil.pate.teachers import ModelRecipe, mean_accuracy, train_teachers

    out = Path(cfg.out) if cfg.out else _default_out(cfg)
    if (out / "labels.npz").exists() or (out / "report.json").exists():
        raise CheckpointError(
            "out",
            str(out),
            "labels were already released from this run folder; labelling again would draw fresh noise on "
            "the same private data and spend the privacy budget a second time",
            "use a new --out folder (teachers can be copied over to skip retraining)",
        )
    # Settings errors before any work (the budget plan depends on public parameters only).
    agg_probe = _aggregator(cfg, cfg.teachers)
    release = (
        _release_params(cfg)
        if cfg.data_dependent and cfg.aggregator != "lnmax" and cfg.budget != "ptr"
        else None
    )

    def settings_for(max_queries: int, num_classes: int) -> LabelSettings:
        return LabelSettings(
            aggregator=agg_probe,
            epsilon=cfg.epsilon,
            delta=cfg.delta,
            max_queries=max_queries,
            num_teachers=cfg.teachers,
            num_classes=num_classes,
            budget=cfg.budget,
            accountant=cfg.accountant,
            data_dependent=cfg.data_dependent,
            release=release,
            check_every=cfg.dd_check_every,
            ptr_test_share=cfg.ptr_test_share,
            ptr_select_share=cfg.ptr_select_share,
            ptr_order=cfg.ptr_order,
            ptr_max_answers=cfg.ptr_max_answers,
        )

    plan_budget(settings_for(cfg.queries or 1, 2), cfg.secure_rng)

    # -- data --------------------------------------------------------------------------------------
    ds = load_dataset(
        cfg.dataset,
        data_dir=cfg.data_dir,
        target=cfg.target,
        test_fraction=cfg.holdout_fraction,
        seed=cfg.seed,
    )
    x_priv, y_priv = ds.x_train, ds.y_train
    if cfg.public_data is not None:
        x_pub, y_pub = load_public_data(cfg.public_data)
        check_public_disjoint(x_priv, x_pub, what="public_data")
        x_pub = x_pub.astype(x_priv.dtype, copy=False)
        if y_pub is not None and (y_pub.shape[0] != x_pub.shape[0]):
            y_pub = None
        x_test, y_test = ds.x_test, ds.y_test
        split = (
            f"private: the {ds.n_train} training examples of '{ds.name}'; public pool: {len(x_pub)} examples "
            f"from {cfg.public_data} (checked: no row equal to a private row); "
            f"test: the {ds.n_test} held-out examples"
        )
        duplicates = 0
    else:
        x_pub, y_pub, x_test, y_test = _split_holdout(ds.x_test, ds.y_test, cfg.public_fraction, cfg.seed)
        split = (
            f"private: the {ds.n_train} training examples of '{ds.name}'; the {ds.n_test} held-out examples "
            f"split (seed {cfg.seed}, stratified) into a public pool of {len(x_pub)} (labels hidden from "
            f"the student, used only to score the released labels) and a test set of {len(x_test)}"
        )
        private_rows = set(row_digests(x_priv))
        duplicates = sum(d in private_rows for d in row_digests(x_pub))
        if duplicates:
            split += (
                f"; {duplicates} public rows equal a private row (independent examples with equal values)"
            )
    if len(x_pub) == 0:
        raise DataError("public pool", 0, "there is nothing for the student to query", "provide public data")
    q_planned = min(cfg.queries or len(x_pub), len(x_pub))
    order = np.random.default_rng(_child_seed(cfg.seed, "queries")).permutation(len(x_pub))[:q_planned]
    x_q = x_pub[order]
    y_q = y_pub[order] if y_pub is not None else None

    # -- teachers ----------------------------------------------------------------------------------
    part = partition_teachers(x_priv, y_priv, cfg.teachers, seed=cfg.seed, groups=groups)

    def recipe(spec: str, seed: int) -> ModelRecipe:
        return ModelRecipe(spec, ds.input_shape, ds.num_classes, ds.kind, ds.pixel_max, seed, cfg.epochs)

    t_factory = teacher_factory or recipe(cfg.teacher_model, cfg.seed)
    s_factory = student_factory or recipe(cfg.student_model, _child_seed(cfg.seed, "student"))
    fingerprint = _fingerprint(
        ds.sha256, part.assignment, x_q, x_test, repr(t_factory), cfg.teachers, cfg.seed, groups is not None
    )

    def show(done: int, total: int) -> None:
        if cfg.progress:
            sys.stderr.write(f"\rteachers trained: {done}/{total}")
            if done == total:
                sys.stderr.write("\n")

    votes = train_teachers(
        x_priv,
        y_priv,
        part.assignment,
        cfg.teachers,
        ds.num_classes,
        x_q,
        x_test,
        t_factory,
        run_dir=out,
        fingerprint=fingerprint,
        workers=cfg.workers,
        progress=show,
    )
    hist = votes.histograms(ds.num_classes)

    # -- private labels ----------------------------------------------------------------------------
    settings = settings_for(q_planned, ds.num_classes)
    rng = make_source(cfg.secure_rng, None if cfg.secure_rng else _child_seed(cfg.seed, "noise"))
    result = label_queries(hist, settings, rng)
    asked = result.queries_asked
    answered_mask = result.labels >= 0
    idx = np.flatnonzero(answered_mask)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "labels.npz", public_index=order[idx], label=result.labels[idx])

    # -- student -----------------------------------------------------------------------------------
    # Public inputs and released labels only (the pool's true labels y_pub are never passed).
    unlabelled = np.ones(len(x_pub), dtype=bool)
    unlabelled[order[idx]] = False
    student = None
    if idx.size or cfg.budget != "ptr":  # a failed PTR test releases nothing: no student
        student = train_student(
            x_q[idx],
            result.labels[idx],
            x_test,
            y_test,
            s_factory,
            x_unlabelled=x_pub[unlabelled],
            semi_supervised=cfg.semi_supervised,
        )
        with open(out / "student.model", "wb") as fh:
            pickle.dump(student.model, fh, protocol=pickle.HIGHEST_PROTOCOL)

    # -- report ------------------------------------------------------------------------------------
    label_acc = float(np.mean(result.labels[idx] == y_q[idx])) if (y_q is not None and idx.size) else None
    srt = -np.sort(-hist[:asked], axis=1)
    margins = (srt[:, 0] - srt[:, 1]).astype(int) if asked else np.zeros(0, dtype=int)
    sizes = part.sizes
    noise: dict[str, float | None] = {
        "sigma" if agg_probe.name != "lnmax" else "laplace_scale": agg_probe.scale
    }
    if agg_probe.name == "confident-gnmax":
        noise.update({"threshold": agg_probe.threshold, "sigma1": agg_probe.sigma1})
    dd_info = None
    if release is not None:
        dd_info = {
            "order": release.order,
            "beta": release.beta,
            "sigma_s": release.sigma_s,
            "confidence": release.confidence,
            "releases": result.releases,
            "released_rdp": result.released_rdp,
            "release_rdp_each": result.release_rdp_per_release,
            "check_every": cfg.dd_check_every if cfg.budget == "data-dependent" else None,
        }
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
    rep = PateReport(
        epsilon=result.epsilon,
        guarantee="ptr" if cfg.budget == "ptr" else "data-independent",
        guarantee_statement="",
        epsilon_data_independent=result.epsilon_data_independent,
        epsilon_data_dependent=result.epsilon_data_dependent,
        delta=cfg.delta,
        target_epsilon=cfg.epsilon,
        budget=cfg.budget,
        privacy_unit=part.unit,
        accountant=cfg.accountant if agg_probe.name == "lnmax" else "rdp",
        aggregator=agg_probe.name,
        noise=noise,
        data_dependent=dd_info,
        events={"answer": result.answer_event, "threshold_check": result.threshold_event},
        teachers=cfg.teachers,
        teacher_sizes={"min": float(sizes.min()), "max": float(sizes.max()), "mean": float(sizes.mean())},
        queries_planned=q_planned,
        queries_asked=asked,
        queries_answered=int(idx.size),
        stop_reason=result.stop_reason,
        label_accuracy=label_acc,
        teacher_accuracy=float(mean_accuracy(votes.test, y_test)),
        student_test_accuracy=student.test_accuracy if student is not None else None,
        student_train_size=student.train_size if student is not None else 0,
        student_semi_supervised=bool(student is not None and student.semi_supervised),
        student_pseudo_labels=student.pseudo_labelled if student is not None else 0,
        ptr=result.ptr,
        dataset={
            "name": ds.name,
            "sha256": ds.sha256,
            "num_classes": ds.num_classes,
            "n_private": len(y_priv),
            "n_public": len(x_pub),
            "n_test": len(y_test),
            "public_private_duplicates": int(duplicates),
            "split": split,
        },
        teacher_model=repr(t_factory) if teacher_factory else cfg.teacher_model,
        student_model=repr(s_factory) if student_factory else cfg.student_model,
        seed=cfg.seed,
        secure_rng=cfg.secure_rng,
        teachers_resumed=votes.resumed,
        veil_version=veil.__version__,
        duration_s=time.time() - t0,
        history={
            "epsilon_curve": [[float(a) for a in row] for row in result.epsilon_curve],
            "released_curve": [[float(a) for a in row] for row in result.released_curve],
        },
        vote_margins={
            "mean": finite_or_none(float(margins.mean())) if margins.size else None,
            "histogram": np.bincount(margins, minlength=cfg.teachers + 1).tolist() if margins.size else [],
        },
        files=files,
        out_dir=str(out),
    )
    rep = rep.model_copy(update={"guarantee_statement": guarantee_text(rep)})
    images = {
        "ε against queries answered": epsilon_png(
            rep.history["epsilon_curve"], rep.history["released_curve"], cfg.epsilon, cfg.delta
        ),
        "Vote margins": margins_png(margins.tolist(), answered_mask.tolist(), cfg.teachers),
    }
    (out / "epsilon.png").write_bytes(images["ε against queries answered"])
    (out / "margins.png").write_bytes(images["Vote margins"])
    (out / "report.html").write_text(render_html(rep, images), encoding="utf-8")
    tmp = out / "report.json.tmp"
    tmp.write_text(rep.to_json(), encoding="utf-8")
    os.replace(tmp, out / "report.json")
    return rep
