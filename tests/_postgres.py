"""A throw-away PostgreSQL server for tests: ``with postgres_server() as url: ...``.

Starts a real server from the Debian ``postgresql`` binaries (``/usr/lib/postgresql/*/bin``, or
``pg_ctl`` on the PATH) in a temporary folder: ``initdb`` with trust authentication, listening only on
a unix socket inside that folder (no TCP port, so parallel servers cannot collide), ``fsync`` off.
As root the server runs as the ``postgres`` user (``runuser``), since PostgreSQL refuses to run as
root. Every step is bounded in time, and the server is stopped and its folder removed on exit.
The URL names the ``postgres`` database and role over the socket, driver psycopg 3.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["pg_bindir", "postgres_server", "postgres_unavailable"]

_STEP_TIMEOUT_S = 60
_PORT = 5432  # only names the socket file; nothing listens on TCP


def pg_bindir() -> Path | None:
    """The folder of ``initdb``/``pg_ctl``, newest major version first; None if not installed."""
    found = shutil.which("pg_ctl")
    if found and Path(found).with_name("initdb").exists():
        return Path(found).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3].split(".")[0])
    )
    return Path(candidates[-1]).parent if candidates else None


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


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


def _run(cmd: list[str], log: Path | None = None) -> None:
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=_STEP_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if result.returncode != 0:
        extra = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr[-2000:]}{extra}")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server, yield its SQLAlchemy URL, stop it and delete its files."""
    reason = postgres_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    bindir = pg_bindir()
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="veil-pg-"))
    data, log = root / "data", root / "server.log"
    prefix = _as_server_user()
    if prefix:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
    os.chmod(root, 0o700)
    started = False
    try:
        _run([*prefix, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
              "-E", "UTF8", "--no-sync", "--no-instructions"])  # fmt: skip
        options = f"-k {root} -p {_PORT} -c listen_addresses='' -c fsync=off -c max_connections=60"
        _run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "30",
             "-o", options, "start"],
            log,
        )  # fmt: skip
        started = True
        yield f"postgresql+psycopg://postgres@/postgres?host={root}&port={_PORT}"
    finally:
        if started:
            with contextlib.suppress(Exception):
                _run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "-t", "30",
                      "stop"])  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
