"""A finished job's run folder, logged to MLflow (``--mlflow [TRACKING_URI]``; the extra ``veil[mlflow]``).

Called once per job, after its ``report.json`` and ``report.html`` are written (the report is the one
source: nothing is recomputed from the data). A tracking store is shared and outlives the run folder,
so the job's MLflow run — the *release run* — holds only what ``release/`` may publish:

* parameters — the privacy settings as the *public* report states them
  (:func:`veil.report.schema.public_view`): target ε, δ, σ, C, q, planned and taken steps,
  accountant, neighbouring relation, privacy unit, dataset, job;
* the metric ``epsilon`` against the step — the public report's own curve when it has one, else the
  curve of its DP-SGD plan (:func:`veil.accounting.calibrate.epsilon_curve`, after its preprocessing
  release) up to the steps taken, else the one ε the report states;
* ``release/report.html`` and ``release/report.json`` (the public report, without the ``non_private``
  section or the dataset's fingerprint) as artifacts under ``release/``;
* the tags ``veil.job``, ``veil.release_ready`` (the public report's) and ``veil.non_private=false``.

The report's ``non_private`` numbers (exact accuracies, counts: computed from the data without
privacy) never reach the release run. Only when asked (``non_private=True``, the flag
``--mlflow-non-private``) are they logged, each as a metric ``non_private.<name>``, in a *child run*
of their own, nested under the release run by MLflow's parent tag and labelled by construction: tags
``veil.non_private=true`` and ``veil.release_ready=false``, its name ``<run> (non-private)``. The
internal report, the ledger and the model are never logged.

Tracking location: ``TRACKING_URI`` as MLflow understands it (``http://host:5000``,
``sqlite:///path.db``, ...); ``local`` (a bare ``--mlflow``) is a SQLite store ``mlflow.db`` with
artifacts under ``mlartifacts/``, both in the run folder's parent (so every run under ``runs/`` lands
in one store). A store MLflow will not write to is refused before the job runs, nothing charged
(:func:`check_tracking_uri`: MLflow not installed; a ``file:`` URI or a plain path, whose file store
this MLflow keeps in maintenance mode unless ``MLFLOW_ALLOW_FILE_STORE=true``). Privacy: the
parameters, the curve, the tag ``veil.release_ready`` and the artifacts come from the public report,
so they are covered by its guarantee; the child run is not, and says so.

Times (revJ's J7, as ``release/``'s for revH's H6): the release run is logged after the job ends,
and the times MLflow would stamp on it by itself — its start, its end, each ``epsilon`` point's
timestamp — minus the reservation time its own ``release/report.json`` states
(``dataset_budget.runs[].at``) would be the job's duration, which grows with private facts (for
``veil tune`` the number of trials its bound assumes secret; for synth and PATE the private N). So
all three are set to the time ``release/`` carries (:func:`veil.report.publish.release_time`, public
already). The child run keeps MLflow's own times: it holds numbers outside the guarantee anyway and
is labelled not to be shared. Not covered: the store's own bookkeeping, which no MLflow call sets —
the experiment ``veil``'s creation time, when the first job logged to a new store created it
(create the experiment beforehand to avoid it), and the times of the artifact files on the store's
disk.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from veil.errors import ConfigError

__all__ = ["LOCAL", "check_tracking_uri", "log_report", "release_millis", "tracking_location"]

LOCAL = "local"
EXPERIMENT = "veil"
_PARAMS = {
    "target_epsilon": ("target_epsilon", "epsilon_target", "epsilon_budget"),
    "delta": ("delta", "target_delta"),
    "noise_multiplier": ("noise_multiplier",),
    "max_grad_norm": ("max_grad_norm", "update_clip_norm"),
    "sampling_rate": ("sampling_rate",),
    "batch_size": ("batch_size",),
    "steps": ("steps", "rounds_charged"),
    "steps_planned": ("steps_planned", "rounds_planned"),
    "accountant": ("accountant",),
    "neighbouring": ("neighbouring",),
    "privacy_unit": ("privacy_unit", "unit"),
    "randomness": ("randomness",),
    "framework": ("framework",),
}


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise ConfigError(
            "mlflow",
            "not installed",
            "logging a run to MLflow needs the mlflow client",
            "pip install 'veil[mlflow]' (mlflow-skinny), or drop --mlflow",
        ) from None
    return mlflow


def check_tracking_uri(uri: str) -> None:
    """Refuse, before the job runs (nothing charged), a tracking location MLflow will not log to:
    MLflow not installed, or a file store (a ``file:`` URI or a plain path) that this MLflow keeps in
    maintenance mode (it raises on the first call unless ``MLFLOW_ALLOW_FILE_STORE=true``)."""
    _mlflow()
    if uri == LOCAL or uri.startswith(("databricks", "uc")):
        return
    from mlflow import environment_variables
    from mlflow.utils.uri import get_uri_scheme

    allowed = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # absent: file stores work
    if get_uri_scheme(uri) in ("", "file") and allowed is not None and not allowed.get():
        raise ConfigError(
            "mlflow",
            uri,
            "this MLflow keeps its file store in maintenance mode and refuses to log to it",
            "give a database or server URI (sqlite:///path/mlflow.db, http://host:5000), a bare --mlflow "
            "(a SQLite store next to the run folder), or set MLFLOW_ALLOW_FILE_STORE=true",
        )


def _published(run_dir: Path) -> dict[str, Any] | None:
    """``release/report.json`` as ``publish`` wrote it (the reservation time it states is the one the
    release run must carry; the report handed back to the command may lack its budget section)."""
    from veil.pipeline.run_folder import RELEASE

    try:
        published = json.loads((run_dir / RELEASE / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return published if isinstance(published, dict) else None


def release_millis(public: Mapping[str, Any]) -> int:
    """The time of every time field of the release run, in MLflow's milliseconds: the time ``release/``
    carries (:func:`veil.report.publish.release_time`, the run's public reservation time), never a time
    the job's length moves. At least 1 ms: MLflow reads 0 as "now"."""
    from veil.report.publish import release_time

    return max(1, round(release_time(public) * 1000))


def tracking_location(uri: str, run_dir: Path) -> tuple[str, str | None]:
    """``(tracking URI, artifact location for a new experiment or None)`` for ``uri`` (see module doc)."""
    if uri != LOCAL:
        return uri, None
    parent = run_dir.resolve().parent
    return f"sqlite:///{parent / 'mlflow.db'}", (parent / "mlartifacts").as_uri()


def log_report(report: Mapping[str, Any], uri: str, *, job: str, non_private: bool = False) -> str:
    """Log the job whose report is ``report`` (its ``out_dir`` holds the files); returns the release
    run's id. ``non_private``: also log the report's non-private numbers, in a child run (module doc)."""
    from veil.pipeline.run_folder import RELEASE
    from veil.report.schema import public_view

    mlflow = _mlflow()
    run_dir = Path(report["out_dir"])
    public = public_view(report)
    tracking, artifacts = tracking_location(uri, run_dir)
    client = mlflow.MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    experiment_id = (
        experiment.experiment_id
        if experiment is not None
        else client.create_experiment(EXPERIMENT, artifact_location=artifacts)
    )

    at = release_millis(_published(run_dir) or public)  # the release run's every time (module doc: Times)

    def log_release(run_id: str) -> None:
        for key, value in params_of(public, job).items():
            client.log_param(run_id, key, value)
        for step, eps in epsilon_points(public):
            client.log_metric(run_id, "epsilon", eps, timestamp=at, step=step)
        for name in ("report.html", "report.json"):
            if (run_dir / RELEASE / name).is_file():
                client.log_artifact(run_id, str(run_dir / RELEASE / name), artifact_path=RELEASE)

    tags = _release_tags(public, job)
    release_id = _logged_run(client, experiment_id, run_dir.name, tags, log_release, at=at)
    if non_private:
        metrics = non_private_metrics(report)

        def log_non_private(run_id: str) -> None:
            for key, value in metrics.items():
                client.log_metric(run_id, key, value)

        tags = _non_private_tags(job, metrics, parent=release_id)
        _logged_run(client, experiment_id, f"{run_dir.name} (non-private)", tags, log_non_private)
    return release_id


def _logged_run(
    client: Any,
    experiment_id: str,
    name: str,
    tags: dict[str, str],
    log: Callable[[str], None],
    *,
    at: int | None = None,
) -> str:
    """A new run with ``tags``, filled by ``log(run_id)``, ended (FAILED if ``log`` raised); started
    and ended at ``at`` (MLflow's milliseconds) when given, else when MLflow is called."""
    run_id: str = client.create_run(experiment_id, start_time=at, run_name=name, tags=tags).info.run_id
    try:
        log(run_id)
    except BaseException:
        client.set_terminated(run_id, status="FAILED", end_time=at)
        raise
    client.set_terminated(run_id, end_time=at)
    return run_id


def _flat(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report with a federated report's ``plan`` and ``guarantee`` sections lifted to the top."""
    sections = [report.get(k) for k in ("plan", "guarantee")]
    return {k: v for part in (*sections, report) if isinstance(part, Mapping) for k, v in part.items()}


def params_of(report: Mapping[str, Any], job: str) -> dict[str, Any]:
    """The privacy settings the report states, under one set of names whatever the job."""
    report = _flat(report)
    out: dict[str, Any] = {"job": job}
    for name, keys in _PARAMS.items():
        value = next((report[k] for k in keys if report.get(k) is not None), None)
        if value is not None:
            out[name] = value
    dataset = report.get("dataset")
    if isinstance(dataset, Mapping):
        out["dataset"] = dataset.get("id") or dataset.get("name")
    elif dataset is not None:
        out["dataset"] = dataset
    if "privacy_unit" not in out and out.get("neighbouring") == "add_or_remove_one":
        out["privacy_unit"] = "one record"
    return out


def epsilon_points(report: Mapping[str, Any]) -> list[tuple[int, float]]:
    """ε against the step (see the module doc for where it comes from)."""
    curve = report.get("epsilon_curve")
    if curve:
        return [(int(p["step"]), float(p["epsilon"])) for p in curve]
    rounds = (report.get("plots") or {}).get("epsilon_per_round")
    if rounds:  # a federated report: ε against the round
        return [(int(k), float(e)) for k, e in rounds]
    report = _flat(report)
    spent = report.get("epsilon_spent", report.get("epsilon"))
    steps = report.get("steps")
    if _dpsgd(report):
        from veil.accounting.calibrate import dpsgd_event, epsilon_curve
        from veil.accounting.events import event_from_dict

        prefix = []
        event = (report.get("preprocessing") or {}).get("event")
        if event is not None:
            prefix.append(event_from_dict(event))
        taken = int(report["steps"])
        step = dpsgd_event(float(report["sampling_rate"]), float(report["noise_multiplier"]))
        points = epsilon_curve(
            step, taken, float(report["delta"]), report.get("accountant", "pld"), prefix=prefix
        )
        return points
    if isinstance(spent, (int, float)) and math.isfinite(spent):
        return [(int(steps) if isinstance(steps, int) else 0, float(spent))]
    return []


def _dpsgd(report: Mapping[str, Any]) -> bool:
    needed = ("sampling_rate", "noise_multiplier", "delta", "steps")
    return all(isinstance(report.get(k), (int, float)) for k in needed) and report["steps"] > 0


def non_private_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """Every finite number of the report's ``non_private`` section, as ``non_private.<name>``."""
    section = report.get("non_private") or {}
    return {
        f"non_private.{k}": float(v)
        for k, v in section.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _release_tags(public: Mapping[str, Any], job: str) -> dict[str, str]:
    return {
        "veil.job": job,
        "veil.release_ready": str(_flat(public).get("release_ready")),
        "veil.non_private": "false",
    }


def _non_private_tags(job: str, metrics: Mapping[str, float], *, parent: str) -> dict[str, str]:
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    return {
        MLFLOW_PARENT_RUN_ID: parent,  # nested under the release run, as mlflow.start_run(nested=True)
        "veil.job": job,
        "veil.non_private": "true",
        "veil.release_ready": "false",
        "non_private_metrics": ",".join(sorted(metrics)),
        "veil.note": "computed from the data without privacy: not covered by the release run's (ε, δ) "
        "guarantee; do not share with the release",
    }
