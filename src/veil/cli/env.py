"""``veil env``: versions of everything that matters, for bug reports."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

import typer

from veil.cli._output import emit

PACKAGES = ("torch", "numpy", "scipy", "pydantic", "typer", "rich", "matplotlib", "jinja2", "scikit-learn")


def environment() -> dict[str, Any]:
    """Versions of veil, Python, the platform and the runtime dependencies."""
    import veil

    info: dict[str, Any] = {
        "veil": veil.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    for name in PACKAGES:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def register(app: typer.Typer) -> None:
    @app.command("env")
    def env_command(json_output: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
        """Print versions of veil, Python, torch, numpy, scipy and friends."""
        emit(environment(), json_output, title="veil environment")
