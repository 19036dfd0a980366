"""``veil audit [CONFIG.toml] [flags]``: measure a training run's leakage next to its promised ε.

Trains with canaries and attacks the model (see :mod:`veil.audit.run`), or, with ``--run DIR``,
attacks the released model of a finished ``veil train`` run. ``--epsilon inf`` or
``--noise-multiplier 0`` audit a non-private (σ = 0) reference run.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from veil.cli import _training_options as opts
from veil.cli._output import emit
from veil.cli._privacy_args import DELTA_HELP


def run_audit(
    config_file: str | None,
    flags: dict[str, Any],
    audit_flags: dict[str, Any],
    run: str | None = None,
    out: str | None = None,
) -> dict[str, Any]:
    """The work of ``veil audit``: resolve settings (defaults < file < flags), audit, return report.json."""
    from veil.audit.run import audit, audit_run, resolve_audit_config, settings_from
    from veil.errors import InvalidParameterError

    if run is not None:
        given = [k for k, v in flags.items() if v is not None]
        if config_file is not None or given:
            extra = "a config file" if config_file else "--" + given[0].replace("_", "-")
            raise InvalidParameterError(
                "--run",
                run,
                f"a finished run is audited with its own saved settings; {extra} would contradict them",
                "drop the data, model and privacy flags (or the config file) when using --run",
            )
        values = dict(audit_flags)
        if values.get("attack") is None:
            values["attack"] = "loss"
        return audit_run(run, settings_from({}, **values), out=out).to_dict()
    cfg, file_audit, non_private = resolve_audit_config(config_file, flags)
    settings = settings_from(file_audit, **audit_flags, non_private=non_private or None)
    return audit(cfg, settings, out=out).to_dict()


# Options of `veil audit` beyond the shared training ones (typer reads them as defaults).
EPSILON = typer.Option(
    None, "--epsilon", help="Target ε of the audited run (default 3); inf audits a σ = 0 run."
)
DELTA = typer.Option(None, "--delta", help=DELTA_HELP + " Also the δ of the ε lower bound.")
NOISE_MULTIPLIER = typer.Option(
    None, "--noise-multiplier", help="σ instead of calibrating it; 0 audits a non-private run."
)
SEED = typer.Option(
    None, "--seed", help="Seed of split and initialisation (and with --reproducible: noise and canaries)."
)
CANARIES = typer.Option(
    None, "--canaries", help="Canaries per kind (default 1000 gradient / 500 input, capped by the data)."
)
CANARY_KIND = typer.Option(
    None, "--canary-kind", help="gradient (white box, default), input (black box) or both."
)
CANARY_DIRECTION = typer.Option(
    None, "--canary-direction", help="dirac (default: quiet coordinates) or random directions."
)
ATTACK = typer.Option(None, "--attack", help="canary (default; with the loss attack), loss, lira or all.")
CONFIDENCE = typer.Option(None, "--confidence", help="Confidence of the ε lower bound (0.95).")
SHADOW_MODELS = typer.Option(None, "--shadow-models", help="LiRA shadow models (default 8).")
LIRA_VARIANT = typer.Option(None, "--lira-variant", help="auto (default), online or offline.")
RUN = typer.Option(None, "--run", help="Audit the model of this finished veil train run instead.")
OUT = typer.Option(None, "--out", help="Output folder (default runs/audit-<dataset>-<time>, or RUN/audit).")
AUDIT_KEYS = (
    "canaries",
    "canary_kind",
    "canary_direction",
    "attack",
    "confidence",
    "shadow_models",
    "lira_variant",
)


def summary(report: dict[str, Any]) -> str:
    """The lines `veil audit` prints without --json."""
    report = {**report, **(report.get("non_private") or {})}  # the measured figures are non-private
    lb, theo = report["epsilon_lower_bound"], report["epsilon_theoretical"]
    lines = [
        f"ε lower bound {'—' if lb is None else f'{lb:.4f}'} at {report['confidence']:.0%} confidence; "
        f"promised ε {'∞ (σ = 0)' if theo is None else f'{theo:.4g}'} (δ = {report['delta']:g}): "
        f"{report['verdict'].replace('_', ' ')}",
    ]
    mia = report.get("mia")
    if mia:
        lines.append(
            f"{mia['attack']} attack: AUC {mia['auc']:.4f}, TPR {mia['tpr_at_1pct_fpr']:.4f} at 1% FPR, "
            f"{mia['tpr_at_0.1pct_fpr']:.4f} at 0.1% FPR"
        )
    lines.append(report["reading"])
    lines.append(
        "non-private: every figure of an audit is computed from the private data; keep it internal"
        + ("" if report.get("randomness", "secure") == "secure" else " (research mode: seeded noise)")
    )
    lines.append(f"report: {report['out_dir']}/report.html")
    return "\n".join(lines) + "\n"


def register(app: typer.Typer) -> None:
    @app.command("audit")
    def audit_command(
        config: str = typer.Argument(
            None,
            metavar="[CONFIG.toml]",
            help="TOML file of training settings, optionally with an [audit] table.",
        ),
        dataset: str = opts.DATASET,
        data_dir: str = opts.DATA_DIR,
        target: str = opts.TARGET,
        model: str = opts.MODEL,
        epsilon: float = EPSILON,
        delta: float = DELTA,
        epochs: int = opts.EPOCHS,
        batch_size: int = opts.BATCH_SIZE,
        max_grad_norm: float = opts.MAX_GRAD_NORM,
        lr: float = opts.LR,
        optimizer: str = opts.OPTIMIZER,
        accountant: str = opts.ACCOUNTANT,
        noise_multiplier: float = NOISE_MULTIPLIER,
        seed: int = SEED,
        reproducible: bool = opts.REPRODUCIBLE,
        secure_rng: bool = opts.SECURE_RNG,
        classes: str = opts.CLASSES,
        canaries: int = CANARIES,
        canary_kind: str = CANARY_KIND,
        canary_direction: str = CANARY_DIRECTION,
        attack: str = ATTACK,
        confidence: float = CONFIDENCE,
        shadow_models: int = SHADOW_MODELS,
        lira_variant: str = LIRA_VARIANT,
        run: str = RUN,
        out: str = OUT,
        json_output: bool = typer.Option(False, "--json", help="Print report.json on stdout."),
    ) -> None:
        """Audit privacy: an empirical ε lower bound (canaries) and membership-inference attacks."""
        values = dict(locals())
        skip = {"config", "run", "out", "json_output", *AUDIT_KEYS}
        flags = {k: v for k, v in values.items() if k not in skip}
        audit_flags = {k: values[k] for k in AUDIT_KEYS}
        report = run_audit(config, flags, audit_flags, run=run, out=out)
        if json_output:
            emit(report, True)
            return
        sys.stdout.write(summary(report))
