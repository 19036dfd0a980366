"""``veil train [CONFIG.toml] [flags]``: DP training end to end, with a report (see :mod:`veil.train`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from veil.cli import _training_options as opts
from veil.cli._mlflow import MLFLOW, MLFLOW_NON_PRIVATE, check_mlflow_flags, log_if_asked
from veil.cli._output import emit, resume_hint
from veil.cli._privacy_args import DELTA_HELP, REGISTRY_DB


def run_train(
    config_file: str | None,
    flags: dict[str, Any],
    resume: str | None = None,
    json_output: bool = False,
    nproc_per_node: int | None = None,
) -> dict[str, Any] | None:
    """The work of ``veil train``: resolve the config (defaults < file < flags), train, return the report.

    Across processes: the launcher :mod:`veil.distributed.job` (``nproc_per_node``), each rank
    :mod:`veil.training.rank` (started by the launcher or torchrun); then
    None on every rank but rank 0."""
    from veil.config import load_config_file, make_config, resolve_config, snake_keys
    from veil.distributed.launch import launched_by_torchrun
    from veil.training import train

    given = {k: v for k, v in flags.items() if v is not None}
    if json_output:
        given["progress"] = False
    if launched_by_torchrun():
        from veil.training.rank import train_as_rank

        return train_as_rank(config_file, given, resume)
    if nproc_per_node is not None:
        from veil.distributed.job import launch_train

        return launch_train(config_file, given, resume, nproc_per_node)
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
        schema: str = opts.SCHEMA,
        table: str = opts.TABLE,
        query: str = opts.QUERY,
        stream: bool = typer.Option(
            None,
            "--stream",
            help="Parquet + --schema: train on Poisson-sampled rows read from the file, never all in memory.",
        ),
        stream_rows: int = typer.Option(
            None, "--stream-rows", help="With --stream: sampled rows held at once (default 1000000)."
        ),
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help="Protect every row sharing this column's value (a person) as one unit; the column is "
            'declared type = "ignored" in the schema (docs/privacy-unit.md).',
        ),
        max_rows_per_unit: int = typer.Option(
            None,
            "--max-rows-per-unit",
            metavar="K",
            help="With --privacy-unit: rows one unit contributes per step at most (default 1024/B, 1..16).",
        ),
        data_dir: str = opts.DATA_DIR,
        dataset_id: str = typer.Option(
            None, "--dataset-id", help="Declared dataset identity in the budget registry (veil budget)."
        ),
        target: str = opts.TARGET,
        model: str = opts.MODEL,
        text_column: str = typer.Option(
            None, "--text-column", help="Column of texts (csv, parquet, sql) for --model hf:DIR."
        ),
        csv_multiline_values: bool = typer.Option(
            None,
            "--csv-multiline-values",
            help="A text CSV's quoted value may span lines. Default: one line, one record. Risk: one "
            "unbalanced quote then merges every later row into one dropped record; declare it only for "
            "a file whose quoting you trust (tables: csv_multiline_values = true in the schema).",
        ),
        fine_tune: str = typer.Option(
            None,
            "--fine-tune",
            help="hf: models: head (frozen encoder, default), lora or full; with --init-from: head, "
            "last-k or full.",
        ),
        init_from: str = typer.Option(
            None,
            "--init-from",
            help="Start from public pretrained weights (state_dict file, veil model.pt or run folder); "
            "declares them public.",
        ),
        last_k: int = typer.Option(
            None, "--last-k", help="Layers trained by --fine-tune last-k (default 2)."
        ),
        precision: str = typer.Option(
            None, "--precision", help="fp32 (default) or bf16 (autocast forward; clipping and noise fp32)."
        ),
        lora_rank: int = typer.Option(None, "--lora-rank", help="LoRA rank r (default 8)."),
        lora_alpha: float = typer.Option(
            None, "--lora-alpha", help="LoRA alpha; scaling alpha/r (default 16)."
        ),
        lora_targets: str = typer.Option(
            None, "--lora-targets", help="Comma-separated module names for LoRA (default: peft's choice)."
        ),
        lora_lr: float = typer.Option(
            None,
            "--lora-lr",
            help="--fine-tune lora: the adapters' learning rate; the head keeps --lr (default: --lr).",
        ),
        max_length: int = typer.Option(None, "--max-length", help="Tokens per text (default 128)."),
        epsilon: float = typer.Option(None, "--epsilon", help="Target ε for the whole run (default 3)."),
        delta: float = typer.Option(None, "--delta", help=DELTA_HELP),
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
            None, "--seed", help="Seed of split and initialisation (and with --reproducible: noise)."
        ),
        reproducible: bool = opts.REPRODUCIBLE,
        secure_rng: bool = opts.SECURE_RNG,
        db: str = REGISTRY_DB,
        classes: str = opts.CLASSES,
        no_baseline: bool = opts.NO_BASELINE,
        out: str = typer.Option(None, "--out", help="Run folder (default runs/<dataset>-<time>)."),
        resume: str = typer.Option(None, "--resume", help="Continue the interrupted run in this folder."),
        audit: bool = typer.Option(
            None, "--audit", help="Add the one-run canary audit: an empirical ε lower bound in the report."
        ),
        json_output: bool = typer.Option(
            False, "--json", help="Print the report JSON on stdout (no progress bar)."
        ),
        nproc_per_node: int = typer.Option(
            None,
            "--nproc-per-node",
            help="Train data-parallel on N local processes (torch.distributed; see docs/distributed.md).",
        ),
        clip: str = typer.Option(None, "--clip", help="fixed (default) or adaptive (follows a quantile)."),
        target_quantile: float = typer.Option(
            None, "--target-quantile", help="Share of examples left unclipped by --clip adaptive."
        ),
        augment: int = typer.Option(
            None,
            "--augment",
            help="Augmentation multiplicity K (images, end-to-end models): K shifted copies per example, "
            "their gradients averaged before clipping (same privacy, K times the compute).",
        ),
        augment_flip: bool = typer.Option(
            None, "--augment-flip", help="Also mirror the --augment copies left-right."
        ),
        mlflow: str = MLFLOW,
        mlflow_non_private: bool = MLFLOW_NON_PRIVATE,
    ) -> None:
        """Train a model with differential privacy and write a report a data-protection officer can file."""
        check_mlflow_flags(mlflow, mlflow_non_private)
        flags: dict[str, Any] = {
            "dataset": dataset,
            "table_schema": schema,
            "table": table,
            "query": query,
            "stream": stream,
            "stream_rows": stream_rows,
            "privacy_unit": privacy_unit,
            "max_rows_per_unit": max_rows_per_unit,
            "data_dir": data_dir,
            "dataset_id": dataset_id,
            "target": target,
            "model": model,
            "text_column": text_column,
            "csv_multiline_values": csv_multiline_values,
            "fine_tune": fine_tune,
            "lora_rank": lora_rank,
            "lora_alpha": lora_alpha,
            "lora_targets": None if lora_targets is None else [t.strip() for t in lora_targets.split(",")],
            "lora_lr": lora_lr,
            "max_length": max_length,
            "init_from": init_from,
            "last_k": last_k,
            "precision": precision,
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
            "reproducible": reproducible,
            "secure_rng": secure_rng,
            "classes": classes,
            "baseline": False if no_baseline else None,
            "out": out,
            "audit": audit,
            "clip": clip,
            "target_quantile": target_quantile,
            "augment": augment,
            "augment_flip": augment_flip,
        }
        from veil.registry.location import registry_location

        with resume_hint(db), registry_location(db):  # an interrupt: one line, how to continue
            report = run_train(
                config, flags, resume=resume, json_output=json_output, nproc_per_node=nproc_per_node
            )
        if report is None:  # a rank other than 0 of a distributed run: rank 0 speaks for the run
            return
        log_if_asked(report, mlflow, "train", mlflow_non_private)
        if json_output:
            emit(report, True)
            return
        sys.stdout.write(summary(report))


def _capped(internal: dict[str, Any]) -> bool:
    return str(internal.get("baseline_stopped") or "").startswith("capped")


def summary(report: dict[str, Any]) -> str:
    """The lines ``veil train`` prints without --json: the guarantee first, the non-private figures
    labelled as such, research mode said plainly."""
    from veil.pipeline.outputs import held_out_accuracy

    folder = Path(report["out_dir"])
    internal = report["non_private"]
    base = internal["baseline_test_accuracy"]
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    lines = [
        f"model.pt: ({report['epsilon_spent']:.3f}, {report['delta']:g})-DP (target ε "
        f"{report['target_epsilon']:g}), randomness {report['randomness']}, "
        + ("release-ready" if report["release_ready"] else "NOT release-ready"),
        f"non-private (internal): test accuracy {held_out_accuracy(internal['test_accuracy'])}"
        + (f", baseline {base:.4f}" if base is not None else "")
        + (" (capped: may understate the cost of privacy)" if _capped(internal) else ""),
        f"checks: {len(report['checks']) - len(failed)}/{len(report['checks'])} passed"
        + (f" (failed: {', '.join(failed)})" if failed else ""),
    ]
    if report["randomness"] != "secure":
        lines.append(
            "research mode (--reproducible): not private against anyone who knows the seed; do not release"
        )
    lines += [f"report: {folder / 'report.html'}", f"        {folder / 'report.json'}"]
    return "\n".join(lines) + "\n"
