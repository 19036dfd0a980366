"""``veil federated``: federated learning with client-level or record-level DP, on Flower.

See :mod:`veil.federated` and ``docs/federated.md``. Flower is the optional extra ``veil[federated]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from veil.accounting.defaults import DEFAULT_DELTA
from veil.cli import _training_options as opts
from veil.cli._mlflow import MLFLOW, MLFLOW_NON_PRIVATE, check_mlflow_flags, log_if_asked
from veil.cli._output import emit, resume_hint
from veil.cli._privacy_args import DELTA_HELP, REGISTRY_DB
from veil.errors import ConfigError


def _flower_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("flwr") is None:
        raise ConfigError(
            "federated",
            "flwr missing",
            "federated runs are executed by Flower, which is not installed",
            "pip install 'veil[federated]'",
        )


MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    # Client level: measured on Fashion-MNIST, 1,000 clients, Dirichlet(0.5), ε = 3 (docs/benchmarks.md,
    # "Federated"): C near the clients' median update norm, local SGD with lr 0.05 on batches of 16.
    "client-level": {"clip": 0.5, "local_lr": 0.05, "local_batch": 16},
    "record-level": {"clip": 1.0, "local_lr": 0.1, "local_batch": 32},
}
"""The defaults of the options the two modes read differently (C of an update or of an example, ...)."""


def run_federated_command(options: dict[str, Any]) -> dict[str, Any]:
    """The work of ``veil federated``: settings from flags, then run (or resume) and report."""
    from veil.federated.privacy import sampling_rate
    from veil.federated.settings import FederatedSettings

    _flower_installed()
    resume = options.pop("resume")
    deployment = options.pop("deployment")
    if resume:
        from veil.federated.run import saved_settings, simulate

        return simulate(saved_settings(Path(resume)).replace(out=str(Path(resume).resolve())), resume=True)
    for name, value in MODE_DEFAULTS.get(options["mode"], {}).items():
        if options.get(name) is None:
            options[name] = value
    rate, per_round = options.pop("client_sampling_rate"), options.pop("clients_per_round")
    k = options.pop("max_rows_per_unit")
    if k is not None:  # 0 stands for the default rule in the settings: a K the user gives must be ≥ 1
        from veil.units import check_max_rows_per_unit

        check_max_rows_per_unit(k)
    options["max_rows_per_unit"] = k or 0
    options["table_schema"] = options.pop("schema") or ""
    for name in ("table", "query", "privacy_unit"):
        options[name] = options[name] or ""
    if options["mode"] == "record-level":
        if rate is not None or per_round is not None:
            raise ConfigError(
                "client_sampling_rate",
                rate if rate is not None else per_round,
                "record-level silos all take part in every round; their records are sampled by DP-SGD",
                "leave out --client-sampling-rate/--clients-per-round with --mode record-level",
            )
        q = 1.0
    else:
        q = sampling_rate(options["clients"], rate, per_round)
    from veil.pipeline.run_folder import default_out

    out = options.pop("out") or str(default_out(options["dataset"], job="federated"))
    settings = FederatedSettings(sampling_rate=q, out=str(Path(out).resolve()), **options)
    if deployment:
        from veil.federated.run import deploy

        return deploy(settings)
    from veil.federated.run import simulate

    return simulate(settings)


def register(app: typer.Typer) -> None:
    @app.command("federated")
    def federated_command(
        mode: str = typer.Option(
            "client-level", "--mode", help="client-level (DP-FedAvg) or record-level (DP-SGD in each silo)."
        ),
        dataset: str = typer.Option(
            "digits", "--dataset", help="digits, fashion-mnist, mnist, breast-cancer, csv:PATH, ..."
        ),
        data_dir: str = typer.Option(
            "", "--data-dir", help="Folder of the IDX files (fashion-mnist, mnist)."
        ),
        schema: str = opts.SCHEMA,
        table: str = opts.TABLE,
        query: str = opts.QUERY,
        privacy_unit: str = typer.Option(
            None,
            "--privacy-unit",
            metavar="COLUMN",
            help="record-level: protect every row sharing this column's value (a person) as one unit; "
            "a person's rows share one silo (docs/privacy-unit.md).",
        ),
        max_rows_per_unit: int = typer.Option(
            None,
            "--max-rows-per-unit",
            metavar="K",
            help="With --privacy-unit: rows one unit contributes per step at most (default 1024/B, 1..16).",
        ),
        dataset_id: str = typer.Option(
            "", "--dataset-id", help="Charge the budget registry under this declared dataset identity."
        ),
        target: str = typer.Option("", "--target", help="Label column (csv) or label array (npz)."),
        clients: int = typer.Option(10, "--clients", help="Number of clients (silos at record level)."),
        client_sampling_rate: float = typer.Option(
            None,
            "--client-sampling-rate",
            help="client-level: each client's probability of joining a round (Poisson).",
        ),
        clients_per_round: int = typer.Option(
            None, "--clients-per-round", help="client-level: expected clients per round (q = K / clients)."
        ),
        rounds: int = typer.Option(20, "--rounds", help="Planned rounds: σ is calibrated for all of them."),
        epsilon: float = typer.Option(
            3.0, "--epsilon", help="Target ε (client- or record-level, by --mode)."
        ),
        delta: float = typer.Option(
            DEFAULT_DELTA,
            "--delta",
            help=DELTA_HELP + " N: clients (client-level) or a silo's rows (people with --privacy-unit).",
        ),
        partition: str = typer.Option("iid", "--partition", help="iid, dirichlet:ALPHA or column:NAME."),
        model: str = typer.Option(
            "auto",
            "--model",
            help="auto, rff, scatternet, logreg, mlp (only the head trains on a fixed front).",
        ),
        clip: float = typer.Option(
            None,
            "--clip",
            help="C: L2 bound of a client's update (client-level, default 0.5) or of an example's gradient "
            "(record-level, default 1).",
        ),
        server_lr: float = typer.Option(1.0, "--server-lr", help="Server step on the noisy mean update."),
        server_optimizer: str = typer.Option(
            "sgd",
            "--server-optimizer",
            help="client-level: sgd, momentum (FedAvgM) or adam (FedAdam) on the noisy mean (free).",
        ),
        server_momentum: float = typer.Option(
            0.9, "--server-momentum", help="client-level: momentum (Adam's β₁) of the server step."
        ),
        local_epochs: int = typer.Option(
            1, "--local-epochs", help="client-level: local SGD epochs per round."
        ),
        local_lr: float = typer.Option(
            None, "--local-lr", help="Local learning rate (default 0.05 client-level, 0.1 record-level)."
        ),
        local_batch: int = typer.Option(
            None, "--local-batch", help="Local batch (default 16; record-level: expected DP-SGD batch, 32)."
        ),
        local_steps: int = typer.Option(
            10, "--local-steps", help="record-level: DP-SGD steps per silo per round."
        ),
        accountant: str = typer.Option("pld", "--accountant", help="pld (default) or rdp."),
        seed: int = typer.Option(
            -1,
            "--seed",
            help="Seed of a research run (implies --reproducible: noise not releasable); default: OS CSPRNG.",
        ),
        reproducible: bool = opts.REPRODUCIBLE,
        db: str = REGISTRY_DB,
        out: str = typer.Option("", "--out", help="Run folder (default runs/federated-<dataset>-<time>)."),
        resume: str = typer.Option(
            "", "--resume", help="Continue the run in this folder (charged rounds are kept)."
        ),
        deployment: bool = typer.Option(
            False,
            "--deployment",
            help="Run as real processes: a SuperLink and one SuperNode per client on loopback.",
        ),
        json_output: bool = typer.Option(False, "--json", help="Print the report JSON on stdout."),
        mlflow: str = MLFLOW,
        mlflow_non_private: bool = MLFLOW_NON_PRIVATE,
    ) -> None:
        """Train a model over clients that keep their data, with differential privacy (Flower)."""
        options = {
            k: v
            for k, v in locals().items()
            if k not in ("json_output", "mlflow", "mlflow_non_private", "reproducible", "db")
        }
        check_mlflow_flags(mlflow, mlflow_non_private)
        from veil.registry.location import registry_location  # after locals(): options are parameters

        if reproducible and seed < 0:  # research mode without a seed of its own: seed 0
            options["seed"] = 0
        with resume_hint(db), registry_location(db):  # Ctrl-C, SIGTERM: one line, how to continue
            report = run_federated_command(options)
        log_if_asked(report, mlflow, "federated", mlflow_non_private)
        if json_output:
            emit(report, True)
            return
        g = report["guarantee"]
        acc = report["non_private"]["final_test_accuracy"]
        lines = [
            f"{g['mode']}: ε = {g['epsilon_spent']:.4g} at δ = {g['delta']:g} ({g['neighbouring']}), "
            f"{g['rounds_charged']} rounds; randomness {report['randomness']}",
            f"final test accuracy (non-private figure) {acc:.4f}" if acc is not None else "no evaluation",
            f"report: {Path(report['out_dir']) / 'report.json'}",
        ]
        sys.stdout.write("\n".join(lines) + "\n")
