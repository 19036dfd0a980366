"""A finished job's run folder, logged to MLflow (``--mlflow [TRACKING_URI]``; the extra ``veil[mlflow]``).

Called once per job, after its ``report.json`` and ``report.html`` are written (the report is the one
source: nothing is recomputed from the data). A tracking store is shared and outlives the run folder,
so it receives what ``release/`` may publish, and nothing of the internal report but its labelled
``non_private`` numbers. What is logged:

* parameters — the privacy settings as the *public* report states them
  (:func:`veil.report.schema.public_view`): target ε, δ, σ, C, q, planned and taken steps,
  accountant, neighbouring relation, privacy unit, dataset, job;
* the metric ``epsilon`` against the step — the public report's own curve when it has one, else the
  curve of its DP-SGD plan (:func:`veil.accounting.calibrate.epsilon_curve`, after its preprocessing
  release) up to the steps taken, else the one ε the report states;
* every number of the report's ``non_private`` section as a metric ``non_private.<name>`` — the
  prefix is added here to every one of them and to nothing else, so such a metric is labelled by its
  name; the run's tag ``non_private_metrics`` lists them, and ``veil.non_private`` explains they are
  not covered;
* ``release/report.html`` and ``release/report.json`` (the public report, without the ``non_private``
  section or the dataset's fingerprint) as artifacts under ``release/``; the internal report, the
  ledger and the model are not logged.

Tracking location: ``TRACKING_URI`` as MLflow understands it (``http://host:5000``,
``sqlite:///path.db``, ...); ``local`` (a bare ``--mlflow``) is a SQLite store ``mlflow.db`` with
artifacts under ``mlartifacts/``, both in the run folder's parent (so every run under ``runs/`` lands
in one store). Privacy: the parameters, the curve, the tag ``veil.release_ready`` and the artifacts
come from the public report, so they are covered by its guarantee; what is not is labelled
``non_private``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veil.errors import ConfigError

__all__ = ["LOCAL", "log_report", "tracking_location"]

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


def tracking_location(uri: str, run_dir: Path) -> tuple[str, str | None]:
    """``(tracking URI, artifact location for a new experiment or None)`` for ``uri`` (see module doc)."""
    if uri != LOCAL:
        return uri, None
    parent = run_dir.resolve().parent
    return f"sqlite:///{parent / 'mlflow.db'}", (parent / "mlartifacts").as_uri()


def log_report(report: Mapping[str, Any], uri: str, *, job: str) -> str:
    """Log the job whose report is ``report`` (its ``out_dir`` holds the files); returns the MLflow run id."""
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
    metrics = non_private_metrics(report)
    run = client.create_run(experiment_id, run_name=run_dir.name, tags=_tags(public, job, metrics))
    run_id: str = run.info.run_id
    try:
        for key, value in params_of(public, job).items():
            client.log_param(run_id, key, value)
        for step, eps in epsilon_points(public):
            client.log_metric(run_id, "epsilon", eps, step=step)
        for key, value in metrics.items():
            client.log_metric(run_id, key, value)
        for name in ("report.html", "report.json"):
            if (run_dir / RELEASE / name).is_file():
                client.log_artifact(run_id, str(run_dir / RELEASE / name), artifact_path=RELEASE)
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
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


def _tags(public: Mapping[str, Any], job: str, metrics: Mapping[str, float]) -> dict[str, str]:
    names = sorted(metrics)
    return {
        "veil.job": job,
        "veil.release_ready": str(_flat(public).get("release_ready")),
        "non_private_metrics": ",".join(names),
        "veil.non_private": "metrics named non_private.* are computed from the data without privacy and "
        "are not covered by the run's (ε, δ) guarantee",
    }
