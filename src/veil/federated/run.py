"""The federated job: check and plan the run, run it on Flower, write the report.

Order (nothing expensive and nothing written before every check passed): settings → the budget
registry's account for the dataset, before a row is read (an exhausted dataset is refused here) →
the data and its partition (the column present; a client may be empty) → σ for the client-level
target over the planned rounds → the whole plan reserved in the registry (refused over budget:
nothing written, nothing charged; record level: a stand-in — the target ε at δ — is reserved before
the data is read, and the silos' plan replaces it once their sizes are known) → the run folder,
its ``settings.json`` first (:func:`start_folder`) →
a fixed front's features of every training row computed once into the run folder (internal,
removed at the end; :mod:`veil.federated.features`) → Flower (the simulation engine here; real
SuperLink/SuperNodes on loopback with :mod:`veil.federated.deploy`) → the registry settled with
what the ledger charged → the report, computed from the run folder. What is charged and why:
:mod:`veil.federated.charge`.

Ctrl-C (SIGINT) or SIGTERM during a simulated run — from the registry's reservation on, while the data
is read and the silos planned as much as inside Flower — stops it: Flower stops its SuperNodes, veil stops
the ServerApp thread (:mod:`veil.federated.stop`) before the registry settles, and once the plan is
charged the job raises :class:`~veil.errors.RunInterrupted` (``veil federated --resume DIR``
continues it): the run folder then holds the run's settings (written as soon as the plan is charged,
or by the interrupt itself while the data was being read), and every charged round is in its ledger
if the server began one. The registry keeps the whole plan charged (:meth:`FederatedCharge.settle
<veil.federated.charge.FederatedCharge.settle>`); nothing is written to ``release/``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from veil.errors import ConfigError, RunInterrupted
from veil.federated.settings import FederatedRunError, FederatedSettings

__all__ = [
    "FederatedRunError",
    "charged",
    "check_request",
    "plan",
    "report_files",
    "run_simulation_engine",
    "simulate",
]


def plan(s: FederatedSettings) -> FederatedSettings:
    """Check the data and its partition, and calibrate σ (client level). Returns the settings to run."""
    check_data(s)
    return _with_sigma(s) if s.mode == "client-level" else s


def check_request(s: FederatedSettings) -> None:
    """What the loader would refuse without reading a row (:func:`veil.data.check_request`), checked
    before the run is charged: such input is refused for free, as by ``veil train``."""
    from veil.data import SCHEMA_CLASSES_FIX
    from veil.data import check_request as check_data_request

    check_data_request(
        s.dataset,
        schema=s.table_schema or None,
        target=s.target or None,
        privacy_unit=s.privacy_unit or None,
        classes_fix=SCHEMA_CLASSES_FIX,
        query=s.query or None,
    )


def check_data(s: FederatedSettings) -> None:
    """Refuse a missing column and (record level) δ ≥ 1/n of a non-empty silo, n its records (rows, or
    units with a privacy unit). An empty client (more clients than rows leaves some) contributes a
    zero update and a silo smaller than its batch trains with fewer records
    (:func:`veil.federated.local.silo_sampling_rate`): neither is refused. A record-level run reads
    the data under its stand-in reservation (:func:`charged`), so a refusal here stays charged."""
    from veil.federated.local import federation

    fed = federation(s)
    if s.mode == "client-level":
        return
    sizes = [fed.records(k) for k in range(len(fed.parts))]
    smallest = min((n for n in sizes if n), default=1)
    what = "units" if fed.units is not None else "records"
    if s.delta >= 1.0 / smallest:
        raise ConfigError(
            "delta",
            s.delta,
            f"δ ≥ 1/n for the smallest silo (n = {smallest} {what}) allows publishing one of its "
            f"{what} outright",
            "pass a smaller --delta",
        )


@contextlib.contextmanager
def quiet_flower() -> Iterator[None]:
    """Flower and Ray log to the console; keep them at warnings so ``--json`` output stays clean."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


STOP_TIMEOUT_S = 60.0
"""How long an interrupted simulation waits for its ServerApp thread to return."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the block, SIGTERM stops the job as Ctrl-C does (a KeyboardInterrupt in the main thread);
    after it, SIGTERM's handler from before is back (also over the one ``ray.init`` installs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


#: The veil modules the ServerApp and ClientApp import inside their functions (and those import in
#: theirs, :func:`import_app_modules`): loaded here, in the main thread, before the ServerApp thread
#: starts.
APP_MODULES = (
    "veil.federated.server",  # apps.make_server_app's main
    "veil.federated.strategy",  # server.serve
    "veil.federated.local",  # server._evaluator, the ClientApp
    "veil.federated.units",  # local.federation
    "veil.federated.charge",  # apps._silo_plan
    "veil.pipeline.seeds",  # server._sources, apps._local_seed
    "veil.accounting.calibrate",  # the ClientApp's train
    "veil.engine",  # local.local_dpsgd
)


def import_app_modules() -> None:
    """Import :data:`APP_MODULES` in the calling (main) thread. A SIGTERM's KeyboardInterrupt
    (:func:`sigterm_interrupts`) raised while the main thread held the import lock left it held, and
    the ServerApp thread then blocked forever on its first lazy import (review revG F7): a module
    already imported takes no lock."""
    for name in APP_MODULES:
        importlib.import_module(name)


def run_simulation_engine(s: FederatedSettings, cpus: int = 2) -> None:
    """Flower's simulation engine (Ray): one virtual SuperNode per client, the ServerApp in-process.

    Whatever ends the engine's call early (Ctrl-C, SIGTERM, a crash), Flower stops its SuperNodes on
    the way out but not the ServerApp thread: it is stopped here (:mod:`veil.federated.stop`) before
    the exception goes on, so that the ledger is final when the registry settles and the process
    can exit."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray kills workers when the machine as a whole is above 95% memory, whoever uses it; a client
    # needs little, so leave the kernel to judge real shortages.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    # Ray's C++ failure-signal handler takes SIGTERM for a crash (stack dump on stderr, the process
    # aborted): SIGTERM stops the run as Ctrl-C does here (sigterm_interrupts), so leave it to Python.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from flwr.simulation import run_simulation

    from veil.federated.apps import make_client_app, make_server_app
    from veil.federated.stop import ServerStop

    backend: dict[str, Any] = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "log_to_driver": False, "logging_level": "error"},
    }
    import_app_modules()  # before the ServerApp thread exists, never in it
    stop = ServerStop()
    with quiet_flower():
        try:
            run_simulation(
                make_server_app(s, stop), make_client_app(s), num_supernodes=s.clients, backend_config=backend
            )
        except BaseException as exc:
            stop.stop(STOP_TIMEOUT_S)
            if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:
                raise KeyboardInterrupt from exc  # ray.init's SIGTERM handler: sys.exit(SIGTERM)
            raise


def raise_if_failed(run_dir: Path) -> None:
    """The server's recorded refusal, or an unfinished run, as one error."""
    from veil.federated.files import ERROR, LEDGER

    error = run_dir / ERROR
    if error.exists():
        raise FederatedRunError(
            "federated run", str(run_dir), error.read_text().strip(), "fix the cause and resume with --resume"
        )
    if not (run_dir / LEDGER).exists():
        raise FederatedRunError(
            "federated run",
            str(run_dir),
            "the server never started the run",
            "see the Flower log above; rerun",
        )


def report_files(run_dir: Path, duration_s: float | None) -> dict[str, Any]:
    """Build the report from the run folder; write ``report.json`` and ``report.html`` (atomically)."""
    from veil.federated.report import write_report

    return write_report(run_dir, duration_s)


def check_new_folder(run_dir: Path) -> None:
    """A fresh run needs a new (or empty) writable folder: a run's ledger must never be overwritten."""
    from veil.pipeline.run_folder import check_out

    check_out(run_dir)


def _rounds_done(run_dir: Path) -> int:
    from veil.accounting.ledger import Ledger
    from veil.federated.files import LEDGER

    if not (run_dir / LEDGER).exists():  # stopped before the server wrote its ledger: no round
        return 0
    ledger = Ledger.open(run_dir / LEDGER)
    return len({r.get("round") for r in ledger.records if r["kind"] == "step"})


def start_folder(s: FederatedSettings, run_dir: Path) -> None:
    """Create the run folder with its settings (``settings.json``, the admitted run's, its registry
    run id included): the first thing written once the plan is charged, so that a run stopped before
    its server wrote the ledger can be continued (:func:`saved_settings` reads it)."""
    from veil.accounting.ledger import atomic_write_text
    from veil.federated.files import SETTINGS

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / SETTINGS, json.dumps(s.to_run_config(), indent=1) + "\n")


def _with_sigma(s: FederatedSettings) -> FederatedSettings:
    from veil.federated.privacy import client_level_sigma

    return s.replace(
        sigma=client_level_sigma(s.epsilon, s.delta, s.sampling_rate, s.rounds, s.clients, s.accountant)
    )


@contextlib.contextmanager
def charged(s: FederatedSettings, run_dir: Path, *, resume: bool = False) -> Iterator[FederatedSettings]:
    """The run's account with the budget registry around running it (see the module doc for the
    order): yields the settings to run, carrying the registry's run id; settles on the way out."""
    from veil.federated.charge import FederatedCharge
    from veil.federated.local import federation

    if not resume:
        check_request(s)  # public mistakes (a schema typo, no label set) refused before any charge
    account = FederatedCharge.before_reading(s, resume=resume)  # before a row is read
    try:
        try:
            if resume:
                account.resume(s, run_dir, max(s.rounds - _rounds_done(run_dir), 0))
            elif s.mode == "client-level":
                # The plan needs no data (σ from the clients' count, q and the rounds): reserved
                # before a row is read; the checks then read the data, so a refusal stays charged
                # (``release`` settles the plan once rows may have been read).
                s = account.with_ids(_with_sigma(s))  # the run id before the registry records it
                s = account.reserve(s, [])
                try:
                    check_data(s)  # σ is calibrated already: the search is not run twice
                except BaseException:
                    account.release()  # settles the plan: reserved as read, never un-charged
                    raise
            else:
                # The silos' sizes (q = B/n) need the data: as veil train, the stand-in (the target
                # ε at δ) is reserved before a row is read, and the plan replaces it once the silos
                # are known; a refusal in between (δ against the smallest silo) stays charged at the
                # stand-in.
                s = account.with_ids(s)  # the run id before the registry records it
                s = account.reserve_stand_in(s)
                try:
                    s = plan(s)
                    fed = federation(s)
                    account.replan(s, [fed.records(k) for k in range(len(fed.parts))])
                except BaseException:
                    account.release()  # rows were read: settled at the stand-in, never un-charged
                    raise
            if not resume:
                start_folder(s, run_dir)
        except KeyboardInterrupt:
            # Charged (the registry recorded the run, even if the interrupt came before its reply),
            # stopped while reserving or reading: the folder names the run, --resume continues it;
            # the reservation stays charged (never released once it may have been recorded).
            if not resume and account.holds(s):
                start_folder(s, run_dir)
            raise
        try:
            yield s
        finally:
            account.settle(s, run_dir)  # what the ledger charged; no ledger: nothing
    finally:
        account.close()


def deploy(s: FederatedSettings, timeout: float = 3600.0) -> dict[str, Any]:
    """Plan, run as real processes on loopback (:func:`veil.federated.deploy.local_deployment`), report."""
    from veil.federated.deploy import local_deployment

    run_dir = Path(s.out)
    check_new_folder(run_dir)
    with sigterm_interrupts(), charged(s, run_dir) as s:  # SIGTERM: as Ctrl-C, from the first charge
        start = time.monotonic()
        local_deployment(s, run_dir / "deployment", timeout=timeout)
    raise_if_failed(run_dir)
    return report_files(run_dir, time.monotonic() - start)


def saved_settings(run_dir: Path) -> FederatedSettings:
    """The settings a run folder was started with, for ``--resume``: its ledger header, or, for a run
    stopped before its server wrote the ledger, the folder's ``settings.json`` (:func:`start_folder`)."""
    from veil.federated.files import LEDGER, SETTINGS

    try:
        if (run_dir / LEDGER).exists():
            header = json.loads((run_dir / LEDGER).read_bytes().split(b"\n", 1)[0])
            return FederatedSettings.from_run_config(header["settings"])
        return FederatedSettings.from_run_config(json.loads((run_dir / SETTINGS).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            "resume",
            str(run_dir),
            "it holds no readable federated run ledger",
            "pass the --out folder of a federated run",
        ) from None


def simulate(s: FederatedSettings, *, resume: bool = False, cpus: int = 2) -> dict[str, Any]:
    """Plan, run in Flower's simulation engine, report. ``resume`` continues the run in ``s.out``."""
    run_dir = Path(s.out)
    if resume:
        s = saved_settings(run_dir)
    else:
        check_new_folder(run_dir)
    from veil.federated.files import LEDGER, SETTINGS
    from veil.federated.local import shared_features

    try:
        # SIGTERM stops the job as Ctrl-C does from before the first charge (reserving, reading the
        # data, planning the silos), not only inside Flower: the folder then says how to continue.
        with sigterm_interrupts(), charged(s, run_dir, resume=resume) as s:
            (run_dir / "error.txt").unlink(missing_ok=True)
            start = time.monotonic()
            # a fixed front's features: computed once, read by every client
            with shared_features(s):
                run_simulation_engine(s, cpus=cpus)
    except KeyboardInterrupt as exc:
        # the registry is settled (the plan stays charged); the folder holds the run's settings and
        # every charged round is in its ledger, if the server began one: --resume continues it
        if (run_dir / SETTINGS).exists() or (run_dir / LEDGER).exists():
            raise RunInterrupted(str(run_dir), "federated") from exc
        raise
    raise_if_failed(run_dir)
    return report_files(run_dir, time.monotonic() - start)
