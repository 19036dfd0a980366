"""Shared test setup: every test gets its own privacy-budget registry (a SQLite file in its tmp folder)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_budget_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Runs record their spend in the registry; a test's runs must not meet another test's (or the user's)."""
    monkeypatch.setenv("VEIL_BUDGET_DB", str(tmp_path / "veil-budget.db"))
