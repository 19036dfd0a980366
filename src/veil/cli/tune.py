"""``veil tune [flags]``: private hyperparameter tuning, the whole procedure accounted (veil.tune)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from veil.accounting.defaults import DEFAULT_DELTA
from veil.cli._mlflow import MLFLOW, MLFLOW_NON_PRIVATE, check_mlflow_flags, log_if_asked
from veil.cli._output import emit
from veil.cli._privacy_args import DELTA_HELP, REGISTRY_DB
from veil.errors import InvalidParameterError


def _values(name: str, text: str | None, kind: type) -> tuple[Any, ...] | None:
    """A comma-separated flag value as a tuple of ``kind`` (``None``: the default)."""
    if text is None:
        return None
    try:
        return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        raise InvalidParameterError(
            name, text, f"each value must be a {kind.__name__}", f"pass e.g. --{name.replace('_', '-')} 1,2"
        ) from None


def run_tune(flags: dict[str, Any]) -> dict[str, Any]:
    """The work of ``veil tune``: the search space from the flags, then :func:`veil.tune.run.tune`."""
    from veil.tune.run import tune

    dims = {
        "lr": _values("lr", flags.pop("lr"), float),
        "epochs": _values("epochs", flags.pop("epochs"), int),
        "batch_size": _values("batch_size", flags.pop("batch_size"), int),
        "max_grad_norm": _values("max_grad_norm", flags.pop("max_grad_norm"), float),
        "model": _values("model", flags.pop("model"), str),
    }
    given = {k: v for k, v in dims.items() if v is not None}  # the others: around the preset
    for key in ("trials_mean", "score_noise"):
        value = flags.get(key)
        if isinstance(value, str) and value != "auto":  # a number, or refused in one line
            parsed = _values(key, value, float)
            flags[key] = parsed[0] if parsed else value
    extra: dict[str, Any] = {}
    for key in ("table_schema", "privacy_unit", "max_rows_per_unit"):  # train settings every trial shares
        value = flags.pop(key, None)
        if value is not None:
            extra[key] = value
    settings: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    return tune(dims=given, extra=extra or None, **settings)


def _against_preset(report: dict[str, Any]) -> str:
    """``; veil train's preset 0.9xxx`` and the recommendation when the comparison ran (non-private
    figures too)."""
    ref = report["non_private"].get("preset_reference")
    if ref is None or ref.get("test_accuracy") is None:
        return ""
    advice = report["non_private"].get("recommendation")
    return f"; veil train's preset at the same ε {ref['test_accuracy']:.4f} (non-private figure)" + (
        f"\n{advice} (non-private: read from test accuracies)" if advice else ""
    )


def register(app: typer.Typer) -> None:
    @app.command("tune")
    def tune_command(
        dataset: str = typer.Option("digits", "--dataset", help="digits (default), breast-cancer, ..."),
        dataset_id: str = typer.Option(
            None, "--dataset-id", help="Declared dataset identity in the budget registry (veil budget)."
        ),
        epsilon: float = typer.Option(3.0, "--epsilon", help="Target ε of the WHOLE tuning procedure."),
        delta: float = typer.Option(DEFAULT_DELTA, "--delta", help=DELTA_HELP),
        lr: str = typer.Option(None, "--lr", help="Learning rates to try, comma-separated."),
        epochs: str = typer.Option(None, "--epochs", help="Epoch counts to try, comma-separated."),
        batch_size: str = typer.Option(None, "--batch-size", help="Batch sizes to try, comma-separated."),
        max_grad_norm: str = typer.Option(
            None, "--max-grad-norm", help="Clip norms to try, comma-separated."
        ),
        model: str = typer.Option(None, "--model", help="Models to try, comma-separated (default auto)."),
        trials_mean: str = typer.Option(
            "auto",
            "--trials-mean",
            help="Mean of the random number of trials (auto: chosen from public settings, docs/tune.md).",
        ),
        trials_law: str = typer.Option(
            "negative_binomial", "--trials-law", help="negative_binomial (truncated, K ≥ 1) or poisson."
        ),
        trials_shape: float = typer.Option(0.5, "--trials-shape", help="Negative binomial shape η ≥ 0."),
        score_noise: str = typer.Option(
            "auto",
            "--score-noise",
            help="Std of the noise on each score count (auto: a share of the rows scored).",
        ),
        preset_share: float = typer.Option(
            0.5, "--preset-share", help="Chance that a trial is veil train's preset (0: never)."
        ),
        compare_preset: bool = typer.Option(
            True,
            "--compare-preset/--no-compare-preset",
            help="Also train veil train's preset for the report's non-private comparison.",
        ),
        tune_anyway: bool = typer.Option(
            False, "--tune-anyway", help="Tune a benchmark whose preset was tuned on it (refused otherwise)."
        ),
        validation_fraction: float = typer.Option(
            0.0,
            "--validation-fraction",
            help="Share of the training split held out for scoring (0: none; each trial trains on "
            "every row and is scored on them, docs/tune.md).",
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the test split and initialisation."),
        out: str = typer.Option(None, "--out", help="Output folder (default runs/<dataset>-tune-<time>)."),
        schema: str = typer.Option(None, "--schema", help="A table's reviewed schema (csv, parquet, sql)."),
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help="Protect every row sharing this column's value (a person): units are trained, held out "
            "and scored whole (docs/privacy-unit.md).",
        ),
        max_rows_per_unit: int = typer.Option(
            None, "--max-rows-per-unit", metavar="K", help="With --privacy-unit: rows per unit per step."
        ),
        db: str = REGISTRY_DB,
        json_output: bool = typer.Option(False, "--json", help="Print the report JSON on stdout."),
        mlflow: str = MLFLOW,
        mlflow_non_private: bool = MLFLOW_NON_PRIVATE,
    ) -> None:
        """Tune hyperparameters privately: a random number of DP runs, the best by a DP score, accounted."""
        check_mlflow_flags(mlflow, mlflow_non_private)
        from veil.registry.location import registry_location

        with registry_location(db):
            report = run_tune(
                {
                    "dataset": dataset,
                    "dataset_id": dataset_id,
                    "epsilon": epsilon,
                    "delta": delta,
                    "lr": lr,
                    "epochs": epochs,
                    "batch_size": batch_size,
                    "max_grad_norm": max_grad_norm,
                    "model": model,
                    "trials_mean": trials_mean,
                    "trials_law": trials_law,
                    "trials_shape": trials_shape,
                    "score_noise": score_noise,
                    "preset_share": preset_share,
                    "compare_preset": compare_preset,
                    "tune_anyway": tune_anyway,
                    "validation_fraction": validation_fraction,
                    "seed": seed,
                    "out": out,
                    "table_schema": schema,
                    "privacy_unit": privacy_unit,
                    "max_rows_per_unit": max_rows_per_unit,
                }
            )
        log_if_asked(report, mlflow, "tune", mlflow_non_private)
        if json_output:
            emit(report, True)
            return
        folder = Path(report["out_dir"])
        acc = report["non_private"]["test_accuracy"]
        sys.stdout.write(
            f"tuning spent ε = {report['epsilon']:.3f} in total (target {report['target_epsilon']:g}), "
            f"δ = {report['delta']:g}; chosen model test accuracy "
            + ("–" if acc is None else f"{acc:.4f}")
            + " (non-private figure)"
            + _against_preset(report)
            + "\n"
            + f"report: {folder / 'report.html'}\n        {folder / 'report.json'}\n"
        )
