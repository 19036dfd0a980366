"""Entry point of the ``veil`` command.

Each subcommand lives in its own module exposing ``register(app)``; the work itself is a plain
function returning a result, testable without a subprocess. Bad input is reported as one line on
stderr with exit status 2: no traceback, nothing half-written. A step after a finished job (logging it
to MLflow) that fails is one line too, with exit status 1: the job's folder and release stand.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import typer

from veil.cli import _examples
from veil.cli._output import CommandInterrupted, FailedAfterTheJob
from veil.errors import VeilError

# Subcommand modules, in help order. A module missing here is simply not offered.
SUBCOMMANDS = (
    "train",
    "epsilon",
    "calibrate",
    "pate",
    "audit",
    "schema",
    "predict",
    "synth",
    "tune",
    "federated",
    "budget",
    "env",
)

EXIT_FAILED_AFTER_THE_JOB = 1  # the job ran and was charged; a later step (MLflow) failed
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="veil",
        help="Differentially private training with tight accounting and auditable reports.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        suggest_commands=False,  # click suggests a near name already; typer's would say it twice
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            None, "--version", is_eager=True, callback=_print_version, help="Print veil's version and exit."
        ),
    ) -> None:
        """Differentially private training with tight accounting and auditable reports."""

    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"veil.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"veil.cli.{name}":
                continue
            raise
        module.register(app)
    for group in app.registered_groups:  # the subcommand groups (schema, budget) suggest once too
        if group.typer_instance is not None:
            group.typer_instance.suggest_commands = False
    _examples.attach(app)
    app.info.epilog = _examples.epilog("")
    return app


def _print_version(value: bool | None) -> None:
    if value:
        import veil

        sys.stdout.write(f"veil {veil.__version__}\n")
        raise typer.Exit(0)


def fail(message: str) -> None:
    """Print one line on stderr."""
    sys.stderr.write("veil: error: " + " ".join(message.split()) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns (and, as a script, exits with) the exit status."""
    from veil.cli._mlflow import with_default_uri
    from veil.pipeline.run_folder import owner_only

    command = typer.main.get_command(build_app())
    args = with_default_uri(sys.argv[1:] if argv is None else argv)
    try:
        with owner_only():  # what a job writes outside release/ is owner-only, whatever the umask
            status = command.main(args=args, prog_name="veil", standalone_mode=False)
    except VeilError as exc:
        fail(str(exc))
        return EXIT_BAD_INPUT
    except CommandInterrupted as exc:
        sys.stderr.write(f"veil: {exc}\n")
        return EXIT_INTERRUPTED
    except FailedAfterTheJob as exc:
        fail(str(exc))
        return EXIT_FAILED_AFTER_THE_JOB
    except Exception as exc:
        # Typer's parser errors (click's, vendored or not, depending on the typer version) are
        # recognised by shape rather than by class so that both layouts work.
        kind = type(exc).__name__
        if kind == "Exit" and hasattr(exc, "exit_code"):
            return int(exc.exit_code)
        if kind == "Abort":
            fail("aborted")
            return EXIT_INTERRUPTED
        if kind == "NoArgsIsHelpError":  # `veil` or `veil schema` alone: the help page was the answer
            sys.stdout.write(exc.format_message() if hasattr(exc, "format_message") else "")
            return 0
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            message = exc.format_message().strip()
            if message:
                fail(message)
            return EXIT_BAD_INPUT
        raise
    except KeyboardInterrupt:
        fail("interrupted")
        return EXIT_INTERRUPTED
    # Outside standalone mode click *returns* the code of an ``Exit`` (typer turns Ctrl-C into
    # ``Exit(130)``); the commands themselves return None.
    if isinstance(status, int) and not isinstance(status, bool):
        if status == EXIT_INTERRUPTED:
            fail("interrupted")
        return status
    return 0


def run() -> None:  # pragma: no cover - console-script shim
    status = main()
    if status == EXIT_INTERRUPTED:
        end_now(status)
    sys.exit(status)


def end_now(status: int) -> NoReturn:
    """End the process at once with ``status``, veil's output flushed: what an interrupted command
    does once its one line is printed and the budget registry settled (``main`` has returned).

    Why: after an interrupt, engines that run threads or actors of their own (Ray and Flower under
    ``veil federated``) go on in the interpreter's teardown — a dying actor's traceback after veil's
    line, and once a crash beside Ray's threads that changed the exit status. Nothing of veil's is
    left to run (its registry transaction is committed, its files written atomically), so the
    teardown is skipped (``os._exit``): the exit status and the output are veil's only. Ray's own
    processes share the interpreter's fate (they end when it does)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
