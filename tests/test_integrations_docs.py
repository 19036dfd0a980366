"""The Hugging Face and Lightning examples of ``docs/integrations.md`` run as written (on the tiny
data they build), and do what the page says (the MLflow example runs in ``test_mlflow_log.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _docs_examples import code_blocks

pytest.importorskip("transformers")
pytest.importorskip("lightning.pytorch")
mlflow = pytest.importorskip("mlflow")


def _run(source: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(source, "docs/integrations.md", "exec"), namespace)
    return namespace


def _logged_epsilons(store: str, experiment: str | None = None) -> list[float]:
    client = mlflow.MlflowClient(tracking_uri=store)
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments])
    if experiment is not None:
        wanted = {e.experiment_id for e in experiments if e.name == experiment}
        runs = [r for r in runs if r.info.experiment_id in wanted]
    return [m.value for r in runs for m in client.get_metric_history(r.info.run_id, "epsilon")]


def test_hf_and_lightning_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the example sets it; undone afterwards
    hf, lightning = code_blocks("integrations.md", "python")[:2]
    assert "DPTrainer" in hf and "DifferentialPrivacy" in lightning
    trainer = _run(hf)["trainer"]
    report = json.loads((tmp_path / "hf-run" / "veil" / "report.json").read_text())
    assert 0 < report["epsilon_spent"] <= 3.0 and report["steps"] == report["steps_planned"] == 3
    assert trainer.report == report  # type: ignore[attr-defined]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert max(_logged_epsilons(store)) == pytest.approx(report["epsilon_spent"])  # via report_to
    privacy = _run(lightning)["privacy"]
    report = json.loads((tmp_path / "veil" / "report.json").read_text())  # default_root_dir: the cwd
    assert report["steps"] == 24
    assert report["epsilon_spent"] == pytest.approx(privacy.epsilon)  # type: ignore[attr-defined]
    assert max(_logged_epsilons(store, "lightning-dp")) == pytest.approx(report["epsilon_spent"])
