"""``--mlflow``: a finished job's report read back from MLflow with ``mlflow.search_runs``."""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _docs_examples import code_blocks

mlflow = pytest.importorskip("mlflow")

from veil.accounting.calibrate import dpsgd_event, epsilon_of  # noqa: E402
from veil.accounting.events import SelfComposed  # noqa: E402
from veil.cli._mlflow import with_default_uri  # noqa: E402
from veil.cli.main import main  # noqa: E402
from veil.mlflow_log import LOCAL, epsilon_points, params_of  # noqa: E402


def test_bare_flag_means_the_local_store() -> None:
    assert with_default_uri(["train", "--mlflow"]) == ["train", "--mlflow", LOCAL]
    assert with_default_uri(["train", "--mlflow", "--json"]) == ["train", "--mlflow", LOCAL, "--json"]
    assert with_default_uri(["train", "--mlflow", "http://h:5000"]) == ["train", "--mlflow", "http://h:5000"]


def test_train_run_read_back_from_mlflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/integrations.md's command, then its read-back with ``mlflow.search_runs``."""
    monkeypatch.chdir(tmp_path)
    (command,) = code_blocks("integrations.md", "bash")
    argv = shlex.split(command.strip())
    assert argv[:2] == ["veil", "train"] and argv[-1] == "--mlflow"
    assert main([*argv[1:-1], "--json", "--mlflow"]) == 0  # a bare --mlflow before another option
    report = json.loads(capsys.readouterr().out)
    read_back = code_blocks("integrations.md", "python")[-1]
    # The read-back sets MLflow's process-wide tracking URI; put back "never set" afterwards, or a later
    # test in this worker (the Trainer's report_to) would log into this test's store.
    tracking_state = mlflow.tracking._tracking_service.utils
    monkeypatch.setattr(tracking_state, "_tracking_uri", tracking_state._tracking_uri)
    namespace: dict[str, Any] = {}  # the default store, next to the run folder; found by MLflow's search
    exec(compile(read_back, "docs/integrations.md", "exec"), namespace)
    capsys.readouterr()
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    run = namespace["run"]
    params = run.data.params
    assert float(params["target_epsilon"]) == report["target_epsilon"] == 3.0
    assert float(params["delta"]) == report["delta"]
    assert float(params["noise_multiplier"]) == pytest.approx(report["noise_multiplier"])
    assert int(params["steps"]) == report["steps"] and params["accountant"] == "pld"
    assert params["privacy_unit"] == "one record" and params["job"] == "train"
    client = mlflow.MlflowClient(tracking_uri=store)
    history = client.get_metric_history(run.info.run_id, "epsilon")
    assert len(history) > 2 and history[0].step == 0 and history[0].value == 0
    assert history[-1].step == report["steps"]
    assert history[-1].value == pytest.approx(report["epsilon_spent"], rel=1e-3)
    assert set(run.data.metrics) == {"epsilon"}  # no non-private number unless asked, even labelled
    assert run.data.tags["veil.non_private"] == "false"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # and no child run
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "release")}
    assert artifacts == {"release/report.html", "release/report.json"}
    local = Path(client.download_artifacts(run.info.run_id, "release/report.json", str(tmp_path / "back")))
    assert json.loads(local.read_text())["epsilon_spent"] == report["epsilon_spent"]


def _numbers(values: Any) -> set[float]:
    """The values that read as numbers (MLflow keeps params and tags as text)."""
    out = set()
    for v in values:
        with contextlib.suppress(TypeError, ValueError):
            out.add(float(v))
    return out


def test_mlflow_receives_the_public_report_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review revA, finding 6: the artifacts are ``release/``'s public report (no ``non_private``
    section, no fingerprint of the private file), the parameters the public report's. Asked for with
    ``--mlflow-non-private``, the non-private numbers are metrics ``non_private.*`` of a child run
    labelled non-private by its tags, and no number of the report's ``non_private`` section is in the
    release run, under any name."""
    import hashlib

    monkeypatch.chdir(tmp_path)  # a store given by URI keeps artifacts under ./mlruns
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(300, 3)), 4)
    rows = "".join(f"{a},{b},{c},{int(a > 0)}\n" for a, b, c in x)
    (tmp_path / "d.csv").write_text("a,b,c,y\n" + rows)
    digest = hashlib.sha256((tmp_path / "d.csv").read_bytes()).hexdigest()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["train", "--dataset", f"csv:{tmp_path / 'd.csv'}", "--target", "y", "--classes", "0,1",
            "--model", "logreg", "--epochs", "1", "--no-baseline", "--delta", "1e-4", "--out",
            str(tmp_path / "run"), "--mlflow", store, "--mlflow-non-private"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["dataset_budget"]["dataset_id"] == f"sha256:{digest}"  # the operator's report has it
    client = mlflow.MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("veil").experiment_id])
    (run,) = [r for r in runs if r.data.tags["veil.non_private"] == "false"]
    (child,) = [r for r in runs if r.data.tags["veil.non_private"] == "true"]
    back = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "back")))
    files = sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file())
    assert files == ["release/report.html", "release/report.json"]
    for name in files:
        text = (back / name).read_text()
        assert digest[:16] not in text and "test_accuracy" not in text, name
    assert "non_private" not in json.loads((back / "release" / "report.json").read_text())
    logged = [*run.data.params.values(), *run.data.tags.values()]
    assert not any(digest[:16] in str(v) for v in logged)
    assert run.data.tags["veil.release_ready"] == str(report["guarantee"]["release_ready"])
    # The release run: the ε curve and the public parameters; no non-private number, by name or value.
    assert set(run.data.metrics) == {"epsilon"}
    exact = _numbers(v for v in report["non_private"].values() if not isinstance(v, bool))
    assert exact  # the exact test accuracy
    curve = [m.value for m in client.get_metric_history(run.info.run_id, "epsilon")]
    released = _numbers([*curve, *run.data.params.values(), *run.data.tags.values()])
    assert not exact & released
    assert not any("non_private" in k for k in [*run.data.params, *run.data.tags] if k != "veil.non_private")
    # The child run: the non-private numbers, labelled by its tags and names, nested under the release.
    assert child.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert child.data.tags["veil.release_ready"] == "false" and child.data.tags["veil.job"] == "train"
    private = set(child.data.metrics)
    assert private and all(k.startswith("non_private.") for k in private)
    assert set(child.data.tags["non_private_metrics"].split(",")) == private
    assert child.data.metrics["non_private.test_accuracy"] == report["non_private"]["test_accuracy"]
    assert not child.data.params and not client.list_artifacts(child.info.run_id)
    # Times (revJ J7): the release run starts, ends and logs every ε point at the public reservation
    # time its own release/report.json states, never when the job ended (their difference would be
    # the job's duration). The child run, outside the guarantee and labelled so, keeps MLflow's times.
    at = _public_millis(back / "release" / "report.json")
    assert run.info.start_time == run.info.end_time == at
    history = client.get_metric_history(run.info.run_id, "epsilon")
    assert history and {m.timestamp for m in history} == {at}
    assert child.info.start_time > at and child.info.end_time >= child.info.start_time


def _public_millis(public_report: Path) -> int:
    """This run's public reservation time ``dataset_budget.runs[].at``, in MLflow's milliseconds."""
    from datetime import datetime

    (this,) = [r for r in json.loads(public_report.read_text())["dataset_budget"]["runs"] if r["this_run"]]
    return round(datetime.fromisoformat(this["at"].replace("Z", "+00:00")).timestamp() * 1000)


def _digits_argv(tmp_path: Path, *more: str) -> list[str]:
    return ["train", "--dataset", "digits", "--model", "logreg", "--epochs", "1", "--no-baseline",
            "--out", str(tmp_path / "run"), *more]  # fmt: skip


def test_a_file_store_this_mlflow_refuses_is_refused_before_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """revJ J7's aside: ``--mlflow file:DIR`` (MLflow keeps its file store in maintenance mode) was a
    traceback after the run; now one line, exit 2, before the job: no run folder, nothing charged."""
    from veil.registry.store import BudgetRegistry

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for uri in (f"file:{tmp_path / 'mlruns'}", str(tmp_path / "mlruns")):
        assert main(_digits_argv(tmp_path, "--mlflow", uri)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "MLFLOW_ALLOW_FILE_STORE" in err, err
        assert not (tmp_path / "run").exists() and not (tmp_path / "mlruns").exists()
    with BudgetRegistry() as registry:
        assert not any(status.runs for status in registry.statuses())


def test_mlflow_failing_after_the_job_is_one_line_and_leaves_the_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store that fails only when used (a SQLite file under a path that is a file): one line, exit 1
    (the job ran and was charged, so not 2), and ``release/`` complete as the job wrote it."""
    (tmp_path / "a-file").write_text("")
    store = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    assert main(_digits_argv(tmp_path, "--mlflow", store)) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("veil: error: the job finished"), err
    assert "Traceback" not in err and str(tmp_path / "run") in err
    release = tmp_path / "run" / "release"
    assert {p.name for p in release.iterdir()} >= {"model.pt", "report.json", "report.html"}


def test_mlflow_non_private_without_mlflow_is_refused_before_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--dataset", "digits", "--model", "logreg", "--epochs", "1", "--no-baseline", "--out",
            str(tmp_path / "run"), "--mlflow-non-private"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--mlflow" in err
    assert not (tmp_path / "run").exists()


def test_params_and_curve_of_an_external_run_report() -> None:
    """A framework adapter's report (veil.pipeline.external): its own curve, its privacy unit."""
    report = {
        "target_epsilon": 3.0,
        "delta": 1e-5,
        "noise_multiplier": 1.1,
        "sampling_rate": 0.01,
        "steps": 20,
        "accountant": "pld",
        "privacy_unit": "one training example",
        "dataset": {"id": "tweets", "n_train": 1000},
        "epsilon_curve": [{"step": 10, "epsilon": 1.0}, {"step": 20, "epsilon": 1.5}],
    }
    assert epsilon_points(report) == [(10, 1.0), (20, 1.5)]
    params = params_of(report, "hf-trainer")
    assert params["dataset"] == "tweets" and params["privacy_unit"] == "one training example"
    del report["epsilon_curve"]  # no curve: the plan's, from the accountant, to the steps taken
    points = epsilon_points(report)
    assert points[-1][0] == 20
    assert points[-1][1] == pytest.approx(epsilon_of([SelfComposed(dpsgd_event(0.01, 1.1), 20)], 1e-5))
