"""The one PostgreSQL fixture of the test suite: a throw-away server from Debian's binaries.

:class:`PostgresServer` runs a real server from the ``postgresql`` binaries (``/usr/lib/postgresql/*/bin``,
or ``pg_ctl`` on the PATH) in a temporary folder: ``initdb`` with a password-protected user (SCRAM over
TCP, trust on the unix socket), ``pg_ctl start`` on a free loopback port and a unix socket in the same
folder, ``fsync`` off, room for 60 connections (the registry's race). PostgreSQL refuses to run as
root, so under root the server runs as the ``postgres`` system user (created by the Debian package)
through ``runuser``, in a folder handed over to that user. Every step is bounded in time; ``stop``
removes the folder. ``with postgres_server() as url:`` wraps start and stop.

Used by the tables tests (sources, wrong passwords, training from PostgreSQL) and the budget
registry's race (``tests/test_registry_concurrency.py``). ``.ci/install-postgres.sh`` installs the
binaries in CI. Every PostgreSQL fixture calls :func:`skip_without_postgres`: a skip on a developer's
machine without the binaries, a failure in CI.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "PG_PASSWORD",
    "PG_USER",
    "PostgresServer",
    "free_port",
    "pg_bindir",
    "postgres_server",
    "postgres_unavailable",
    "skip_without_postgres",
]

PG_USER = "veil"
PG_PASSWORD = "veil-test-pw"
_STEP_TIMEOUT_S = 120


def pg_bindir() -> Path | None:
    """The folder of ``initdb``/``pg_ctl``, newest major version first; None if not installed."""
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3].split(".")[0])
    )
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and Path(found).with_name("initdb").exists() else None


def postgres_unavailable() -> str | None:
    """Why no server can be started here (for pytest.skip), or None."""
    if pg_bindir() is None:
        return "PostgreSQL server binaries not installed (.ci/install-postgres.sh installs them)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    return None


def skip_without_postgres() -> None:
    """Skip the calling test or fixture when no server can start here, but *fail* it in CI (``CI``
    set in the environment, as every CI service does): there the PostgreSQL tests must run, and a
    skip would let the suite pass without them."""
    import pytest

    reason = postgres_unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the PostgreSQL tests, but no server can start here: {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A loopback TCP port nothing listens on (at the time of the call)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A PostgreSQL server for one test session (see the module docstring)."""

    def __init__(self, bindir: Path | None = None) -> None:
        found = bindir or pg_bindir()
        if found is None:
            raise RuntimeError(postgres_unavailable() or "no PostgreSQL binaries")
        self.bindir = found
        self.as_root = os.geteuid() == 0
        self.folder = Path(tempfile.mkdtemp(prefix="veil-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.started = False

    def _run(self, *args: str | Path) -> None:
        cmd = [str(a) for a in args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=_STEP_TIMEOUT_S,
            cwd=self.folder,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            log = self.folder / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr or done.stdout}\n{tail}")

    def start(self) -> PostgresServer:
        pwfile = self.folder / "pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        if self.as_root:
            shutil.chown(self.folder, "postgres", "postgres")
            shutil.chown(pwfile, "postgres", "postgres")
        os.chmod(self.folder, 0o700)
        self._run(
            self.bindir / "initdb", "-D", self.data, "-U", PG_USER, f"--pwfile={pwfile}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off "
            "-c max_connections=60"
        )
        self._run(
            self.bindir / "pg_ctl", "-D", self.data, "-l", self.folder / "log", "-o", options,
            "-w", "-t", "60", "start",
        )  # fmt: skip
        self.started = True
        return self

    def url(self, password: str = PG_PASSWORD, database: str = "postgres") -> str:
        """A SQLAlchemy URL over TCP with the user's password (driver psycopg 3)."""
        return f"postgresql+psycopg://{PG_USER}:{password}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        try:
            if self.started:
                with contextlib.suppress(Exception):
                    self._run(self.bindir / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            self.started = False
            shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server, yield its SQLAlchemy URL, stop it and delete its files."""
    reason = postgres_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    server = PostgresServer()
    try:
        server.start()
        yield server.url()
    finally:
        server.stop()
