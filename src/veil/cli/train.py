"""``veil train [CONFIG.toml] [flags]``: DP training end to end, with a report (see :mod:`veil.train`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from veil.cli import _training_options as opts
from veil.cli._output import emit


def run_train(
    config_file: str | None, flags: dict[str, Any], resume: str | None = None, json_output: bool = False
) -> dict[str, Any]:
    """The work of ``veil train``: resolve the config (defaults < file < flags), train, return the report."""
    from veil.config import load_config_file, make_config, resolve_config, snake_keys
    from veil.training import train

    given = {k: v for k, v in flags.items() if v is not None}
    if json_output:
        given["progress"] = False
    if resume is not None:
        values: dict[str, Any] = {}
        if config_file is not None:
            values.update(load_config_file(config_file))
        values.update(given)
        make_config(values)  # typos and wrong types are refused on resume too
        report = train(snake_keys(values), resume=resume)
    else:
        report = train(resolve_config(config_file, given))
    return report.to_dict()


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_command(
        config: str = typer.Argument(
            None, metavar="[CONFIG.toml]", help="TOML file of settings (flags override it)."
        ),
        dataset: str = opts.DATASET,
        data_dir: str = opts.DATA_DIR,
        target: str = opts.TARGET,
        model: str = opts.MODEL,
        epsilon: float = typer.Option(None, "--epsilon", help="Target ε for the whole run (default 3)."),
        delta: float = typer.Option(None, "--delta", help="Target δ, must be < 1/N (default 1e-5)."),
        epochs: int = opts.EPOCHS,
        batch_size: int = opts.BATCH_SIZE,
        max_grad_norm: float = opts.MAX_GRAD_NORM,
        lr: float = opts.LR,
        optimizer: str = opts.OPTIMIZER,
        accountant: str = opts.ACCOUNTANT,
        noise_multiplier: float = typer.Option(
            None,
            "--noise-multiplier",
            help="σ instead of calibrating it; training still stops at the target ε.",
        ),
        seed: int = typer.Option(
            None, "--seed", help="Seed of split, initialisation and (without --secure-rng) noise."
        ),
        secure_rng: bool = typer.Option(None, "--secure-rng", help="Noise and sampling from the OS CSPRNG."),
        no_baseline: bool = typer.Option(None, "--no-baseline", help="Skip the non-private baseline."),
        out: str = typer.Option(None, "--out", help="Run folder (default runs/<dataset>-<time>)."),
        resume: str = typer.Option(None, "--resume", help="Continue the interrupted run in this folder."),
        audit: bool = typer.Option(
            None, "--audit", help="Add the one-run canary audit: an empirical ε lower bound in the report."
        ),
        json_output: bool = typer.Option(
            False, "--json", help="Print the report JSON on stdout (no progress bar)."
        ),
    ) -> None:
        """Train a model with differential privacy and write a report a data-protection officer can file."""
        flags: dict[str, Any] = {
            "dataset": dataset,
            "data_dir": data_dir,
            "target": target,
            "model": model,
            "epsilon": epsilon,
            "delta": delta,
            "epochs": epochs,
            "batch_size": batch_size,
            "max_grad_norm": max_grad_norm,
            "lr": lr,
            "optimizer": optimizer,
            "accountant": accountant,
            "noise_multiplier": noise_multiplier,
            "seed": seed,
            "secure_rng": secure_rng,
            "baseline": False if no_baseline else None,
            "out": out,
            "audit": audit,
        }
        report = run_train(config, flags, resume=resume, json_output=json_output)
        if json_output:
            emit(report, True)
            return
        folder = Path(report["out_dir"])
        base = report["baseline_test_accuracy"]
        lines = [
            f"DP test accuracy {report['test_accuracy']:.4f}"
            + (f" (non-private baseline {base:.4f})" if base is not None else "")
            + f" at ε = {report['epsilon_spent']:.3f} (target "
            f"{report['target_epsilon']:g}), δ = {report['delta']:g}",
            f"checks: {sum(c['passed'] for c in report['checks'])}/{len(report['checks'])} passed",
            f"report: {folder / 'report.html'}",
            f"        {folder / 'report.json'}",
        ]
        sys.stdout.write("\n".join(lines) + "\n")
