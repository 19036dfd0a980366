"""Every public name the README and ``docs/*.md`` use still imports.

Read from the pages themselves: each Python code block (a fence marked ``python``/``py``, or an
unmarked fence whose text parses as Python) is walked with ``ast`` for ``import veil...`` and
``from veil... import X``; inline code and prose lines are scanned for the same two statements;
and every dotted name ``veil.a.b`` written in backticks (``veil.hf.DPTrainer``,
``veil.audit.run.audit(...)``) is resolved too. A module must import, and each name must be an
attribute of its module or a submodule of it, so renaming or moving a documented name without its
pages fails here, naming the page and the statement.

A name that needs an optional extra that is not installed (transformers, flwr, lightning, ...) is
skipped, named, rather than failed: the import error names a module outside ``veil``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.M | re.S)
_INLINE_FROM = re.compile(r"from\s+(veil(?:\.\w+)*)\s+import\s+\(?\s*([\w\s,]+?)\s*\)?\s*(?:`|$|;|\n)", re.M)
_INLINE_IMPORT = re.compile(r"(?<![\w.])import\s+(veil(?:\.\w+)*)\b")
_DOTTED = re.compile(r"`(veil(?:\.[A-Za-z_]\w*)+)")
NOT_PYTHON = {
    "veil.unit": "docs/privacy-unit.md: the domain string of the unit-id hash, not a module",
    "veil.non_private": "docs/integrations.md: an MLflow tag key in a search filter, not a module",
}
"""Backticked dotted words that are not Python names, each with what it is."""


def _code_blocks(text: str) -> list[str]:
    """Python fences, and unmarked fences, that parse as Python (not shell, TOML, or a sketch with
    ``...same settings...`` in it: the line-by-line scan of :func:`_imports_in_text` covers those)."""
    blocks = []
    for lang, body in _FENCE.findall(text):
        if lang not in ("python", "py", "python3", ""):
            continue
        try:
            ast.parse(body)
        except SyntaxError:
            continue
        blocks.append(body)
    return blocks


def _imports_in_code(code: str) -> set[tuple[str, str | None]]:
    """(module, name) for ``from module import name``; (module, None) for ``import module``."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "veil"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "veil":
            found |= {(node.module, a.name) for a in node.names}
    return found


def _imports_in_text(text: str) -> set[tuple[str, str | None]]:
    """The same statements written inline (in backticks or prose), and backticked dotted names."""
    found: set[tuple[str, str | None]] = set()
    for module, names in _INLINE_FROM.findall(text):
        found |= {(module, n.strip()) for n in names.split(",") if n.strip().isidentifier()}
    found |= {(m, None) for m in _INLINE_IMPORT.findall(text)}
    for dotted in _DOTTED.findall(text):
        if dotted not in NOT_PYTHON:
            found.add((dotted, None))
    return found


def documented_imports(text: str) -> set[tuple[str, str | None]]:
    """Every (module or dotted name, imported name) a page uses."""
    found = _imports_in_text(text)
    for block in _code_blocks(text):
        found |= _imports_in_code(block)
    return found


def resolve(module: str, name: str | None) -> None:
    """Import ``module`` (a dotted name may end in attributes: ``veil.hf.DPTrainer``) and get ``name``
    from it; AttributeError/ImportError if either is gone."""
    parts = module.split(".")
    obj = None
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != "veil":
                raise
            continue
        for attr in parts[i:]:
            obj = _attribute(obj, attr)
        break
    assert obj is not None
    if name is not None and name != "*":
        _attribute(obj, name)


def _attribute(obj: object, name: str) -> object:
    """``getattr``, or the submodule ``obj.name`` (``from veil import hf`` needs no attribute yet)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        module = getattr(obj, "__name__", None)
        if module is None or not hasattr(obj, "__path__"):
            raise
        try:
            return importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{module}.{name}":
                raise
            raise AttributeError(f"{module} has no {name}") from exc


def _cases() -> list[tuple[str, str, str | None]]:
    cases = set()
    for page in PAGES:
        for module, name in documented_imports(page.read_text(encoding="utf-8")):
            cases.add((page.relative_to(ROOT).as_posix(), module, name))
    return sorted(cases, key=lambda c: (c[0], c[1], c[2] or ""))


CASES = _cases()


def test_the_pages_are_read() -> None:
    """The parser finds the imports the pages are known to show (so an empty list cannot pass)."""
    assert ("README.md", "veil", None) in CASES
    assert ("docs/integrations.md", "veil.hf", "DPTrainer") in CASES
    assert any(page.startswith("docs/") and name is not None for page, _, name in CASES)


def test_the_parser_sees_every_form() -> None:
    text = (
        "Use `from veil.a import B, C` or\n```python\nimport veil.d\nfrom veil.e import (F,\n    G)\n```\n"
        "and `veil.h.I(...)`; not ```bash\nveil train --x\n```\n"
    )
    assert documented_imports(text) == {
        ("veil.a", "B"),
        ("veil.a", "C"),
        ("veil.d", None),
        ("veil.e", "F"),
        ("veil.e", "G"),
        ("veil.h.I", None),
    }


def test_a_missing_name_fails() -> None:
    with pytest.raises(AttributeError):
        resolve("veil.accounting.calibrate", "no_such_function")
    with pytest.raises(AttributeError):
        resolve("veil.accounting.no_such_module", None)


@pytest.mark.parametrize(("page", "module", "name"), CASES, ids=[f"{p}:{m}:{n}" for p, m, n in CASES])
def test_documented_name_imports(page: str, module: str, name: str | None) -> None:
    try:
        resolve(module, name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "veil":
            pytest.skip(f"{module}: needs the optional dependency {exc.name}")
        raise AssertionError(f"{page}: {module} does not import ({exc})") from exc
    except (AttributeError, ImportError) as exc:
        what = module if name is None else f"from {module} import {name}"
        raise AssertionError(f"{page} documents `{what}`, which no longer resolves: {exc}") from exc
