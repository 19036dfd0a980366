"""The layer order of ``docs/architecture.md``: cli → jobs → pipeline → core, arrows down only.

Each top-level package or module of ``src/veil`` has its layer declared once in :data:`LAYER`; a
module may import its own package and any package of its layer or a lower one. An import from a
lower layer up to a higher one fails the test unless it is in :data:`KNOWN_UPWARD`, the upward
imports the code had when this test was written (each with why it is there); a new one fails, and
an entry that no longer exists fails too, so the list only shrinks. The graph is
:func:`test_import_graph.import_graph` (function-level and type-only imports included).
"""

from __future__ import annotations

from test_import_graph import SRC, import_graph

CORE, PIPELINE, JOBS, CLI = 0, 1, 2, 3
_NAMES = {CORE: "core", PIPELINE: "pipeline", JOBS: "jobs", CLI: "cli"}

LAYER: dict[str, int] = {
    # core: mechanisms, accounting, the engine and what it is built from (data_parallel: its pieces
    # across ranks; the launcher and rank-side job stay in distributed/), data and model building
    # blocks, the budget registry (the pipeline charges it; it imports no step)
    **dict.fromkeys(
        [
            "accountants",
            "accounting",
            "augment",
            "clipping",
            "compat",
            "config",
            "data",
            "data_parallel",
            "engine",
            "errors",
            "host_release",
            "layers",
            "loss_path",
            "mechanisms",
            "mixing_probe",
            "models",
            "noise_ahead",
            "optimizer",
            "per_example_loss",
            "plan",
            "precision",
            "presets",
            "progress",
            "registry",
            "sampling",
            "tables",
            "text",
            "toml_syntax",
            "units",
            "utils",
            "validation",
            "validators",
        ],
        CORE,
    ),
    # pipeline: the steps every job shares, the report, MLflow logging, multi-process setup
    **dict.fromkeys(["pipeline", "report", "mlflow_log", "distributed"], PIPELINE),
    # jobs: one per subcommand family (hf: DPTrainer over veil.text; lightning: the callback)
    # predict: veil predict, a released table model rebuilt through the pipeline
    **dict.fromkeys(
        ["training", "audit", "pate", "tune", "synth", "federated", "hf", "lightning", "predict"], JOBS
    ),
    **dict.fromkeys(["cli", "__main__"], CLI),
}

# Empty: every upward import the code had when this test was written has been removed (issue 26).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the ``veil`` facade itself


def upward_imports(graph: dict[str, set[str]], layer: dict[str, int]) -> set[tuple[str, str]]:
    """Every edge (importer, imported) from a package to one in a higher layer."""
    found = set()
    for importer, targets in graph.items():
        source = _package(importer)
        for target in targets:
            dest = _package(target)
            if source is None or dest is None or source == dest:
                continue
            if layer[dest] > layer[source]:
                found.add((importer, target))
    return found


def test_every_package_has_a_layer() -> None:
    root = SRC / "veil"
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    packages |= {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    assert not packages - set(LAYER), "declare the layer of " + ", ".join(sorted(packages - set(LAYER)))
    assert not set(LAYER) - packages, "no such package: " + ", ".join(sorted(set(LAYER) - packages))


def test_the_check_sees_an_upward_import() -> None:
    graph = {"veil.engine": {"veil.training", "veil.errors"}, "veil.training": {"veil.engine"}}
    assert upward_imports(graph, LAYER) == {("veil.engine", "veil.training")}


def test_no_new_upward_import() -> None:
    found = upward_imports(import_graph(), LAYER)
    new = sorted(found - KNOWN_UPWARD)
    assert not new, "upward imports (lower layer → higher): " + "; ".join(
        f"{a} ({_NAMES[LAYER[_package(a) or '']]}) → {b} ({_NAMES[LAYER[_package(b) or '']]})" for a, b in new
    )
    gone = sorted(KNOWN_UPWARD - found)
    assert not gone, "no longer upward, remove from KNOWN_UPWARD: " + "; ".join(f"{a} → {b}" for a, b in gone)
