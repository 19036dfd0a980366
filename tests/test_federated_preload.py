"""The ServerApp thread imports nothing veil has not imported before it starts (review revG F7).

A SIGTERM's KeyboardInterrupt raised while the main thread held the import lock left it held, and the
ServerApp thread hung on its first lazy import. ``run.import_app_modules`` loads them in the main
thread first: this checks that its list covers every veil import inside a function of the modules
the apps run (a new lazy import there must join ``APP_MODULES``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import veil.federated

FILES = ("apps.py", "server.py", "strategy.py", "local.py", "aggregate.py", "privacy.py")


def _lazy_veil_imports() -> set[str]:
    here = Path(veil.federated.__file__).parent
    names: set[str] = set()
    for file in FILES:
        for fn in ast.walk(ast.parse((here / file).read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("veil"):
                    for alias in node.names:  # `from veil.federated import local` names a module
                        full = f"{node.module}.{alias.name}"
                        names.add(full if _is_module(full) else str(node.module))
                elif isinstance(node, ast.Import):
                    names.update(a.name for a in node.names if a.name.startswith("veil"))
    return names


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_import_app_modules_covers_every_lazy_veil_import_of_the_apps() -> None:
    wanted = _lazy_veil_imports()
    assert "veil.federated.server" in wanted and "veil.pipeline.seeds" in wanted
    code = (
        "import json, sys\n"
        "from veil.federated.run import import_app_modules\n"
        "import_app_modules()\n"
        f"print(json.dumps(sorted(set({sorted(wanted)!r}) - set(sys.modules))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
