"""Run a federation as real processes on this machine: a SuperLink, one SuperNode per client, ``flwr run``.

This is how a deployment runs (each SuperNode would sit with its data holder; here they share
loopback): :func:`local_deployment` starts ``flower-superlink`` and ``flower-supernode`` processes
on free ports in their own process groups, writes a Flower App folder whose components are veil's
``server_app`` / ``client_app`` and whose run config holds the settings, submits it with
``flwr run <app> <connection> --stream`` through a Flower configuration in a private ``FLWR_HOME``,
waits (bounded by ``timeout``) and stops every process it started. Runtime dependency installation is
disabled: the app's code is veil itself, already importable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from veil.federated.settings import FederatedSettings

__all__ = ["free_port", "local_deployment", "write_app"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    """A Flower command next to this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def write_app(folder: Path, s: FederatedSettings) -> Path:
    """A Flower App folder (``pyproject.toml`` only) running veil's apps with ``s`` as run config."""
    import tomli_w

    folder.mkdir(parents=True, exist_ok=True)
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": "veil-federated",
            "version": "1.0.0",
            "description": "veil's DP federated learning app",
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "veil",
                    "components": {
                        "serverapp": "veil.federated.apps:server_app",
                        "clientapp": "veil.federated.apps:client_app",
                    },
                    "config": s.to_run_config(),
                }
            }
        },
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    return folder


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until something accepts connections on ``port`` (the SuperLink is up), or it died / timed out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"flower-superlink did not start listening on 127.0.0.1:{port}")


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        _stop(procs)


def local_deployment(
    s: FederatedSettings, work: Path, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Start a SuperLink and ``s.clients`` SuperNodes on loopback, ``flwr run`` veil's app, stop them.

    Returns the finished ``flwr run`` process (its output holds the streamed log). Logs of every
    process are in ``work``. Raises ``subprocess.TimeoutExpired`` past ``timeout`` (all stopped).
    """
    work.mkdir(parents=True, exist_ok=True)
    home = work / "flwr-home"
    home.mkdir(exist_ok=True)
    link = free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "veil-local"\n\n'
        f'[superlink.veil-local]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    # The SuperLink and SuperNodes start their helpers (flower-superexec, flwr-serverapp, ...) by name.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    app = write_app(work / "app", s)
    with _processes() as procs:
        procs.append(
            _start(
                [
                    _tool("flower-superlink"),
                    "--insecure",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(link),
                    "--database",
                    str(work / "superlink.db"),
                    "--disable-runtime-dependency-installation",
                ],
                work / "superlink.log",
                env,
            )
        )
        _wait_listening(link, procs[0], timeout=min(60.0, timeout))
        for k in range(s.clients):
            procs.append(
                _start(
                    [
                        _tool("flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link}",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        f"partition-id={k} num-partitions={s.clients}",
                    ],
                    work / f"supernode-{k}.log",
                    env,
                )
            )
        return subprocess.run(
            [_tool("flwr"), "run", str(app), "veil-local", "--stream"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
