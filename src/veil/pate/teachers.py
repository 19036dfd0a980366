"""Teacher training: one model per disjoint partition, in parallel processes, resumable.

Teachers are trained *without* privacy: the guarantee comes from the noisy aggregation of their
votes (:mod:`veil.pate.aggregators`), which only needs each private example to influence one
teacher (:mod:`veil.pate.partition`). Anything a teacher computes from its own partition
(standardisation, early stopping) is therefore allowed; nothing may look at another partition.

Models come from a *factory* ``factory(teacher_index) -> estimator`` whose result has
``fit(x, y)`` and ``predict(x) -> labels`` (scikit-learn style). :class:`ModelRecipe` builds the
built-in ones: ``sklearn-logreg``, ``sklearn-mlp``, ``sklearn-scatter-logreg`` (logistic regression
on fixed wavelet scattering features, :mod:`veil.models.scattering`; images only), ``torch-logreg``,
``torch-mlp``, ``torch-cnn`` (the :mod:`veil.models` zoo trained by a plain torch loop), or
``package.module:factory`` with ``factory(input_shape, num_classes) -> nn.Module`` (the same
convention as ``veil train``).

Resuming: each finished teacher's votes (and its pickled model) are written atomically under
``<run>/teachers/``; a rerun with the same fingerprint skips them. A folder written for another
configuration is refused (:class:`~veil.errors.CheckpointError`).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from veil.data.rows import flat_rows
from veil.errors import CheckpointError, ConfigError, InvalidParameterError
from veil.pipeline.run_folder import write_files

__all__ = [
    "ABSTAIN",
    "BUILTIN_MODELS",
    "Estimator",
    "ModelRecipe",
    "TeacherVotes",
    "train_teachers",
]

BUILTIN_MODELS = (
    "sklearn-logreg",
    "sklearn-mlp",
    "sklearn-scatter-logreg",
    "torch-logreg",
    "torch-mlp",
    "torch-cnn",
)


ABSTAIN = -1
"""The vote of a teacher without data (an empty partition): no class; it adds nothing to any count
(:mod:`veil.pate.partition` argues why the privacy analyses are unchanged)."""


class Estimator(Protocol):
    def fit(self, x: np.ndarray, y: np.ndarray) -> Any: ...

    def predict(self, x: np.ndarray) -> np.ndarray: ...


Factory = Callable[[int], Estimator]

SCATTER_C = 1.0
"""Inverse L2 penalty of ``sklearn-scatter-logreg`` (on standardised scattering features)."""


def _scale(x: np.ndarray, pixel_max: float | None) -> np.ndarray:
    """Public rescaling: images by their documented pixel range; tables untouched (see estimators)."""
    flat = flat_rows(np.asarray(x, dtype=np.float32))
    return flat / pixel_max if pixel_max else flat


class _Constant:
    """The model of a partition with a single class: predicts that class."""

    def __init__(self, label: int) -> None:
        self.label = int(label)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.full(len(x), self.label, dtype=np.int64)


def _full_proba(proba: np.ndarray, classes: np.ndarray, num_classes: int) -> np.ndarray:
    """Probabilities over the classes seen in training spread into one column per class 0..C−1."""
    out = np.zeros((len(proba), max(num_classes, int(np.max(classes)) + 1)))
    out[:, np.asarray(classes, dtype=np.int64)] = proba
    return out


# Scattering features of the arrays a process sees repeatedly (the public pool and the test set are
# predicted by every teacher): a fixed, public per-example map, cached by content.
_FEATURES: dict[tuple[str, int, int], np.ndarray] = {}


def scatter(x: np.ndarray, input_shape: tuple[int, ...], pixel_max: float | None, J: int = 2) -> np.ndarray:
    """Flattened scattering features (:func:`veil.models.scattering.scattering_features`, ``J``,
    8 angles) of images scaled to [0, 1] by their public pixel range; cached for arrays of ≥ 500
    rows. A fixed per-example map with no data-dependent part: it costs no privacy."""
    import hashlib

    from veil.models.scattering import scattering_features

    a = np.asarray(x, dtype=np.float32)
    if len(input_shape) != 3:
        raise ConfigError(
            "model",
            "sklearn-scatter-logreg",
            f"scattering features need images (C×H×W), and this data has shape {input_shape}",
            "use sklearn-logreg or sklearn-mlp for tables",
        )
    key = ("", 0, 0)
    if len(a) >= 500:
        key = (hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(), len(a), J)
        if key in _FEATURES:
            return _FEATURES[key]
    imgs = a.reshape((len(a), *input_shape)) / (pixel_max or 1.0)
    feats = flat_rows(scattering_features(imgs, J=J))
    if key[1]:
        if len(_FEATURES) >= 4:
            _FEATURES.pop(next(iter(_FEATURES)))
        _FEATURES[key] = feats
    return feats


class SklearnEstimator:
    """A scikit-learn classifier on flattened, publicly rescaled inputs (standardised on its own data)."""

    def __init__(
        self,
        name: str,
        pixel_max: float | None,
        seed: int,
        max_iter: int = 300,
        input_shape: tuple[int, ...] = (),
        num_classes: int = 2,
    ) -> None:
        self.name, self.pixel_max, self.seed, self.max_iter = name, pixel_max, seed, max_iter
        self.input_shape, self.num_classes = tuple(input_shape), int(num_classes)
        self.model: Any = None

    def _x(self, x: np.ndarray) -> np.ndarray:
        if self.name == "sklearn-scatter-logreg":
            return scatter(x, self.input_shape, self.pixel_max)
        return _scale(x, self.pixel_max)

    def fit(self, x: np.ndarray, y: np.ndarray) -> SklearnEstimator:
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        from sklearn.neural_network import MLPClassifier
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        y = np.asarray(y, dtype=np.int64)
        if np.unique(y).size < 2:
            self.model = _Constant(int(y[0]))
            return self
        if self.name == "sklearn-mlp":
            clf: Any = MLPClassifier(
                hidden_layer_sizes=(128,), max_iter=self.max_iter, random_state=self.seed
            )
        elif self.name == "sklearn-scatter-logreg":
            # Standardised with this model's own training data only (a teacher: its partition).
            clf = LogisticRegression(max_iter=self.max_iter, C=SCATTER_C)
        else:
            clf = LogisticRegression(max_iter=self.max_iter, C=1.0)
        steps = (
            [clf] if (self.pixel_max and self.name != "sklearn-scatter-logreg") else [StandardScaler(), clf]
        )
        self.model = make_pipeline(*steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.model.fit(self._x(x), y)
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        if isinstance(self.model, _Constant):
            return self.model.predict(x)
        return np.asarray(self.model.predict(self._x(x)), dtype=np.int64)

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """One probability column per class ``0..C−1``."""
        if isinstance(self.model, _Constant):
            out = np.zeros((len(x), max(self.num_classes, self.model.label + 1)))
            out[:, self.model.label] = 1.0
            return out
        proba = np.asarray(self.model.predict_proba(self._x(x)))
        return _full_proba(proba, self.model.classes_, self.num_classes)


class TorchEstimator:
    """An ``nn.Module`` (zoo name or ``package.module:factory``) trained by a plain Adam loop."""

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        kind: str,
        pixel_max: float | None,
        seed: int,
        epochs: int,
        lr: float = 1e-3,
        batch_size: int = 64,
    ) -> None:
        self.model_name, self.input_shape, self.num_classes = model, tuple(input_shape), int(num_classes)
        self.kind, self.pixel_max, self.seed = kind, pixel_max, int(seed)
        self.epochs, self.lr, self.batch_size = int(epochs), float(lr), int(batch_size)
        self.net: Any = None
        self.offset: np.ndarray | None = None
        self.scale_: np.ndarray | None = None

    def _inputs(self, x: np.ndarray) -> Any:
        import torch

        a = np.asarray(x, dtype=np.float32)
        if self.pixel_max:
            a = a / self.pixel_max
        elif self.offset is not None and self.scale_ is not None:
            a = (a - self.offset) * self.scale_
        return torch.from_numpy(np.ascontiguousarray(a.reshape((len(a), *self.input_shape))))

    def fit(self, x: np.ndarray, y: np.ndarray) -> TorchEstimator:
        import torch

        from veil.models import build_model

        torch.manual_seed(self.seed)
        if not self.pixel_max:  # tables: standardise with this teacher's own data (allowed, see module)
            a = np.asarray(x, dtype=np.float32)
            self.offset = a.mean(axis=0)
            self.scale_ = 1.0 / np.maximum(a.std(axis=0), 1e-6)
        name = self.model_name[len("torch-") :] if self.model_name.startswith("torch-") else self.model_name
        self.net = build_model(name, self.input_shape, self.num_classes, self.kind)
        xt = self._inputs(x)
        yt = torch.as_tensor(np.asarray(y, dtype=np.int64))
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        gen = torch.Generator().manual_seed(self.seed)
        loss_fn = torch.nn.CrossEntropyLoss()
        self.net.train()
        for _ in range(self.epochs):
            order = torch.randperm(len(yt), generator=gen)
            for start in range(0, len(yt), self.batch_size):
                idx = order[start : start + self.batch_size]
                opt.zero_grad()
                loss_fn(self.net(xt[idx]), yt[idx]).backward()
                opt.step()
        self.net.eval()
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.predict_proba(x).argmax(axis=1).astype(np.int64)

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Softmax outputs, one column per class ``0..C−1``."""
        import torch

        out = []
        with torch.no_grad():
            for start in range(0, len(x), 1024):
                out.append(torch.softmax(self.net(self._inputs(x[start : start + 1024])), dim=1).numpy())
        return np.concatenate(out).astype(np.float64) if out else np.zeros((0, self.num_classes))


@dataclass(frozen=True)
class ModelRecipe:
    """A picklable description of a built-in or user model; ``recipe(i)`` builds teacher ``i``'s."""

    spec: str
    input_shape: tuple[int, ...]
    num_classes: int
    kind: str
    pixel_max: float | None
    seed: int
    epochs: int = 20

    def __post_init__(self) -> None:
        if self.spec not in BUILTIN_MODELS and ":" not in self.spec:
            import difflib

            close = difflib.get_close_matches(self.spec, BUILTIN_MODELS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                "model",
                self.spec,
                "unknown teacher/student model",
                f"{hint}use one of {', '.join(BUILTIN_MODELS)} or package.module:factory",
            )
        if self.spec in ("torch-cnn", "sklearn-scatter-logreg") and len(self.input_shape) != 3:
            raise ConfigError(
                "model",
                self.spec,
                f"{self.spec} needs images (C×H×W), and this data has shape {self.input_shape}",
                "use sklearn-logreg, sklearn-mlp or torch-mlp for tables",
            )

    def __call__(self, index: int) -> Estimator:
        seed = (self.seed * 1_000_003 + int(index)) % (2**31)
        if self.spec.startswith("sklearn-"):
            return SklearnEstimator(
                self.spec, self.pixel_max, seed, input_shape=self.input_shape, num_classes=self.num_classes
            )
        return TorchEstimator(
            self.spec, self.input_shape, self.num_classes, self.kind, self.pixel_max, seed, self.epochs
        )


@dataclass(frozen=True)
class TeacherVotes:
    """Each teacher's predicted label on every public query (``public``) and test example (``test``)."""

    public: np.ndarray
    test: np.ndarray
    sizes: np.ndarray
    resumed: int

    def histograms(self, num_classes: int) -> np.ndarray:
        """Vote counts per public query, shape ``(n_public, num_classes)``; an abstaining teacher
        (:data:`ABSTAIN`) counts nothing, so a row sums to the teachers with data (at most K)."""
        k, n = self.public.shape
        out = np.zeros((n, num_classes), dtype=np.int64)
        for t in range(k):
            votes = self.public[t]
            voted = votes != ABSTAIN
            out[np.flatnonzero(voted), votes[voted]] += 1
        return out


# -- worker side ---------------------------------------------------------------------------------
_SHARED: dict[str, np.ndarray] = {}


def _init_worker(public: np.ndarray, test: np.ndarray) -> None:
    _SHARED["public"], _SHARED["test"] = public, test
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def predict_labels(model: Any, x: np.ndarray) -> np.ndarray:
    """``model.predict(x)`` as int64 labels; no call on zero rows (the keyed split may hold no test
    row out, and scikit-learn refuses an empty input), an empty array instead."""
    if len(x) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(model.predict(x), dtype=np.int64)


def _train_one(
    index: int, factory: Factory, x: np.ndarray, y: np.ndarray, folder: str | None, num_classes: int
) -> tuple[int, np.ndarray, np.ndarray]:
    from threadpoolctl import threadpool_limits

    model: Any = None
    if len(y) == 0:  # an empty partition: the teacher abstains on every query (no model is fitted)
        votes_public = np.full(len(_SHARED["public"]), ABSTAIN, dtype=np.int64)
        votes_test = np.full(len(_SHARED["test"]), ABSTAIN, dtype=np.int64)
    else:
        with threadpool_limits(1):
            model = factory(index)
            model.fit(x, y)
            votes_public = predict_labels(model, _SHARED["public"])
            votes_test = predict_labels(model, _SHARED["test"])
    for v in (votes_public, votes_test) if model is not None else ():
        if v.size and (v.min() < 0 or v.max() >= num_classes):
            raise InvalidParameterError(
                "teacher", index, "a teacher predicted a label outside 0..C-1", "fix the model's predict()"
            )
    if folder is not None:
        base = Path(folder) / f"teacher_{index:05d}"
        buf = io.BytesIO()
        np.savez(buf, public=votes_public, test=votes_test, n_train=np.int64(len(y)))
        model_bytes = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
        # In order; the votes last: they mark the teacher as done.
        write_files(Path(folder), {f"{base.name}.model": model_bytes, f"{base.name}.npz": buf.getvalue()})
    return index, votes_public, votes_test


def _load_done(folder: Path, k: int, n_public: int, n_test: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    done = {}
    for t in range(k):
        path = folder / f"teacher_{t:05d}.npz"
        if not path.exists():
            continue
        try:
            with np.load(path) as z:
                pub, tst = np.asarray(z["public"]), np.asarray(z["test"])
        except Exception:  # a truncated file: retrain that teacher
            continue
        if pub.shape == (n_public,) and tst.shape == (n_test,):
            done[t] = (pub, tst)
    return done


def _check_manifest(folder: Path, fingerprint: str, k: int) -> None:
    manifest = folder / "manifest.json"
    if manifest.exists():
        try:
            old = json.loads(manifest.read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("fingerprint") != fingerprint or old.get("teachers") != k:
            raise CheckpointError(
                "out",
                str(folder.parent),
                "this run folder holds teachers of another configuration (data, partition, model or "
                "number of teachers); mixing them would break the one-example-one-teacher analysis",
                "use a new --out folder, or rerun with the original settings",
            )
        return
    write_files(folder, {manifest.name: json.dumps({"fingerprint": fingerprint, "teachers": k}, indent=2)})


def train_teachers(
    x_private: np.ndarray,
    y_private: np.ndarray,
    assignment: np.ndarray,
    num_teachers: int,
    num_classes: int,
    x_public: np.ndarray,
    x_test: np.ndarray,
    factory: Factory,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    fingerprint: str = "",
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> TeacherVotes:
    """Train teacher ``t`` on ``x_private[assignment == t]`` for every t; return all votes.

    ``workers`` processes (capped at ``os.cpu_count()``) train teachers concurrently; 1 trains
    them in this process. With ``run_dir``, finished teachers are saved and skipped on a rerun.
    """
    k = int(num_teachers)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidParameterError("workers", workers, "a number of processes", "pass an integer ≥ 1")
    workers = min(workers, os.cpu_count() or 1, k)
    folder = Path(run_dir) / "teachers" if run_dir is not None else None
    done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if folder is not None:
        _check_manifest(folder, fingerprint, k)
        done = _load_done(folder, k, len(x_public), len(x_test))
    resumed = len(done)
    todo = [t for t in range(k) if t not in done]
    sizes = np.bincount(assignment, minlength=k)
    jobs = [(t, x_private[assignment == t], y_private[assignment == t]) for t in todo]
    out_dir = str(folder) if folder is not None else None
    finished = resumed
    if workers == 1 or len(jobs) <= 1:
        _init_worker(x_public, x_test)
        for t, xs, ys in jobs:
            _, vp, vt = _train_one(t, factory, xs, ys, out_dir, num_classes)
            done[t] = (vp, vt)
            finished += 1
            if progress:
                progress(finished, k)
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # fork after torch/BLAS threads can deadlock
        with ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(x_public, x_test)
        ) as pool:
            futures = [
                pool.submit(_train_one, t, factory, xs, ys, out_dir, num_classes) for t, xs, ys in jobs
            ]
            for fut in as_completed(futures):
                t, vp, vt = fut.result()
                done[t] = (vp, vt)
                finished += 1
                if progress:
                    progress(finished, k)
    public = np.stack([done[t][0] for t in range(k)]) if k else np.zeros((0, len(x_public)), np.int64)
    test = np.stack([done[t][1] for t in range(k)]) if k else np.zeros((0, len(x_test)), np.int64)
    return TeacherVotes(public=public, test=test, sizes=sizes, resumed=resumed)


def mean_accuracy(votes: np.ndarray, y: np.ndarray) -> float:
    """Mean over the teachers with data of each one's accuracy against ``y`` (nan if ``y`` is empty or
    every teacher abstains)."""
    voting = votes[np.any(votes != ABSTAIN, axis=1)] if votes.ndim == 2 else votes
    if voting.size == 0 or len(y) == 0:
        return math.nan
    return float(np.mean(voting == np.asarray(y)[None, :]))
