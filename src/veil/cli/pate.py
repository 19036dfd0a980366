"""``veil pate [CONFIG.toml] [flags]``: private labels from a teacher ensemble, a student, a report.

See :mod:`veil.pate.run` and ``docs/pate.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from veil.cli._mlflow import MLFLOW, MLFLOW_NON_PRIVATE, check_mlflow_flags, log_if_asked
from veil.cli._output import emit
from veil.cli._privacy_args import DELTA_HELP, REGISTRY_DB


def run_pate_command(config_file: str | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The work of ``veil pate``: resolve the config (defaults < file < flags), run, return the report."""
    from veil.pate.config import resolve_pate_config
    from veil.pate.run import run_pate

    cfg = resolve_pate_config(config_file, {k: v for k, v in flags.items() if v is not None})
    return run_pate(cfg).to_dict()


_NOT_CONFIG = ("config", "json_output", "mlflow", "mlflow_non_private", "db")


def register(app: typer.Typer) -> None:
    @app.command("pate")
    def pate_command(
        config: str = typer.Argument(
            None, metavar="[CONFIG.toml]", help="TOML file of settings (flags override it)."
        ),
        dataset: str = typer.Option(
            None,
            "--dataset",
            help="digits (default), breast-cancer, fashion-mnist, mnist, csv:PATH, npz:PATH.",
        ),
        data_dir: str = typer.Option(
            None, "--data-dir", help="Folder of the IDX files (fashion-mnist, mnist)."
        ),
        dataset_id: str = typer.Option(
            None, "--dataset-id", help="Declared dataset identity in the budget registry (veil budget)."
        ),
        target: str = typer.Option(None, "--target", help="Label column (csv) or label array (npz)."),
        teachers: int = typer.Option(None, "--teachers", help="Number of teachers K (default 50)."),
        aggregator: str = typer.Option(
            None, "--aggregator", help="gnmax (default), confident-gnmax or lnmax."
        ),
        epsilon: float = typer.Option(None, "--epsilon", help="Target ε (default 2)."),
        delta: float = typer.Option(None, "--delta", help=DELTA_HELP),
        queries: int = typer.Option(None, "--queries", help="Most queries asked (default: the whole pool)."),
        public_data: str = typer.Option(
            None, "--public-data", help=".npz (x, optional y) or .npy of public examples for the student."
        ),
        sigma: float = typer.Option(None, "--sigma", help="GNMax σ (σ₂), or LNMax scale b, in votes."),
        threshold: float = typer.Option(None, "--threshold", help="Confident-GNMax threshold T."),
        sigma1: float = typer.Option(None, "--sigma1", help="Confident-GNMax threshold noise σ₁."),
        budget: str = typer.Option(
            None,
            "--budget",
            help="data-independent (default), data-dependent, or ptr (Propose-Test-Release: the "
            "data-dependent analysis made a worst-case guarantee).",
        ),
        semi_supervised: bool = typer.Option(
            None,
            "--semi-supervised/--no-semi-supervised",
            help="Self-train the student on the unlabelled public pool (default on; no privacy cost).",
        ),
        teacher_model: str = typer.Option(
            None,
            "--teacher-model",
            help="sklearn-logreg (default), sklearn-mlp, torch-cnn, ... or pkg.mod:factory.",
        ),
        student_model: str = typer.Option(None, "--student-model", help="As --teacher-model."),
        workers: int = typer.Option(None, "--workers", help="Processes training teachers (≤ CPU cores)."),
        classes: str = typer.Option(
            None, "--classes", help="The public label set in class order, e.g. no,yes (own data: required)."
        ),
        seed: int = typer.Option(
            None, "--seed", help="Seed of split, partition, query order and models (not of the noise)."
        ),
        reproducible: bool = typer.Option(
            None,
            "--reproducible",
            help="Research mode: noise seeded by --seed (replayable, NOT private against whoever knows the "
            "seed; never release-ready). Default: noise from the OS CSPRNG.",
        ),
        out: str = typer.Option(None, "--out", help="Run folder (default runs/pate-<dataset>-<time>)."),
        db: str = REGISTRY_DB,
        json_output: bool = typer.Option(False, "--json", help="Print the report JSON on stdout."),
        mlflow: str = MLFLOW,
        mlflow_non_private: bool = MLFLOW_NON_PRIVATE,
    ) -> None:
        """Label public data with a noisy vote of teachers trained on disjoint private partitions (PATE)."""
        # Every flag parameter is named as its config key.
        flags: dict[str, Any] = {k: v for k, v in locals().items() if k not in _NOT_CONFIG}
        flags["progress"] = None if json_output else True
        check_mlflow_flags(mlflow, mlflow_non_private)
        from veil.registry.location import registry_location  # after locals(): flags are parameters

        with registry_location(db):
            report = run_pate_command(config, flags)
        log_if_asked(report, mlflow, "pate", mlflow_non_private)
        if json_output:
            emit(report, True)
            return
        sys.stdout.write(_summary(report))


def _summary(report: dict[str, Any]) -> str:
    """The few lines ``veil pate`` prints without ``--json``: the same lines whatever the private N
    (no count from the private rows; an empty test side prints "none", as ``veil train`` does)."""
    from veil.pipeline.outputs import held_out_accuracy
    from veil.pipeline.randomness import RESEARCH_CAVEAT

    folder = Path(report["out_dir"])
    dd = report["epsilon_data_dependent"]
    acc = report["non_private"]["student_test_accuracy"]
    lines = [
        (
            f"student test accuracy {held_out_accuracy(acc)} (non-private, internal)"
            if "student.model" in report["files"]
            else "no student (no label released)"
        )
        + f" from {report['queries_answered']} "
        f"private labels ({report['queries_asked']} queries asked, {report['teachers']} teachers, "
        f"{report['aggregator']})",
        f"ε = {report['epsilon']:.4g} ({report['pate']['guarantee']} guarantee) at δ = {report['delta']:g}; "
        f"data-independent {report['epsilon_data_independent']:.4g}, data-dependent "
        + (f"{dd:.4g} (released)" if dd is not None else "not analysed"),
        "release-ready: secure randomness and every check passed"
        if report["release_ready"]
        else "NOT release-ready: "
        + (
            RESEARCH_CAVEAT
            if report["randomness"] == "seeded"
            else "a check failed (see the report's checklist)"
        ),
        f"report: {folder / 'report.html'}",
        f"        {folder / 'report.json'}",
    ]
    return "\n".join(lines) + "\n"
