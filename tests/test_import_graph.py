"""No import circle anywhere in ``src/veil``.

The graph is built from the source with :mod:`ast` (nothing is imported): an edge A → B for every
``import B`` or ``from B import name`` in module A, at any depth (function-level imports are
dependencies too), imports under ``if TYPE_CHECKING:`` included. A type-only import never runs, but
it is a dependency all the same: the importing module's signatures are written in the other module's
terms, mypy and a reader must load both, and a lower module that names a higher one's class is no
longer lower. Where a lower module needs a shape from above it declares a ``Protocol`` (what it uses of
the object), or the shared type moves down to a module both import (e.g. :mod:`veil.plan`).
``from pkg import sub`` points at ``pkg.sub`` when ``sub`` is a module. A module's edge to its own
ancestor package is skipped: Python runs a package's ``__init__`` before any of its modules anyway.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    """Module → the veil modules it imports."""
    paths = sorted((SRC / "veil").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for p in paths:
        name = _module_name(p)
        targets = _imports(ast.parse(p.read_text(encoding="utf-8")), modules)
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_graph_sees_known_edges() -> None:
    graph = import_graph()
    assert "veil.accounting.events" in graph["veil.accounting.calibrate"]
    assert "veil.errors" in graph["veil.accounting.calibrate"]
    lazy_and_typing = "if TYPE_CHECKING:\n    from veil.a import X\ndef f():\n    import veil.b\n"
    assert _imports(ast.parse(lazy_and_typing), {"veil.a", "veil.b"}) == {"veil.a", "veil.b"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_veil() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_accounting_imports_neither_config_nor_torch() -> None:
    paths = sorted((SRC / "veil" / "accounting").rglob("*.py"))
    for p in paths:
        tree = ast.parse(p.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
            n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
        }
        bad = {n for n in names if n.split(".")[0] == "torch" or n.startswith("veil.config")}
        assert not bad, f"{p.name} imports {bad}"
