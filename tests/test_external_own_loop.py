"""A loop of the user's own around ``veil.PrivacyEngine``: the bare engine is not charged (its ε is
per engine), and ``docs/budget.md``'s ``ExternalRun`` example, run as written, charges the registry
the way the Hugging Face and Lightning adapters do (revF F6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from _docs_examples import code_blocks
from veil import PrivacyEngine
from veil.errors import BudgetExhaustedError
from veil.registry.charge import open_registry
from veil.registry.identity import dataset_identity


def _parts() -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(200, 4, generator=g), torch.randint(0, 2, (200,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loader": DataLoader(dataset, batch_size=20),
        "criterion": torch.nn.CrossEntropyLoss(),
    }


def _runs(dataset_id: str) -> list[Any]:
    registry = open_registry()
    try:
        return list(registry.status(dataset_identity(dataset_id=dataset_id), per_run=True).runs)
    finally:
        registry.close()


def _budget_example() -> str:
    (block,) = [b for b in code_blocks("budget.md", "python") if "ExternalRun" in b]
    return block


def test_the_bare_engine_is_not_charged() -> None:
    """What docs/budget.md says: ``make_private`` alone never opens the registry."""
    parts = _parts()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=parts["model"],
        optimizer=parts["optimizer"],
        data_loader=parts["loader"],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for x, y in loader:
        optimizer.zero_grad()
        parts["criterion"](model(x), y).backward()
        optimizer.step()
    assert engine.get_epsilon(1e-5) > 0 and not _runs("patients")


def test_the_documented_own_loop_is_charged_and_refused_over_budget(tmp_path: Path) -> None:
    """docs/budget.md's ExternalRun block, run as written: the registry holds one settled run whose ε
    is the report's; with the budget spent, a second run is refused at ``begin``, before the engine
    is built (no row read)."""
    namespace = {"__name__": "__docs__", "run_folder": tmp_path / "run", **_parts()}
    exec(compile(_budget_example(), "docs/budget.md", "exec"), namespace)
    report = namespace["report"]
    assert report["release_ready"] and report["steps"] == report["steps_planned"] == 20
    assert json.loads((tmp_path / "run" / "report.json").read_text())["epsilon_spent"] == pytest.approx(
        report["epsilon_spent"]
    )
    (charged,) = _runs("patients")
    assert charged.job == "own-loop"
    registry = open_registry()
    try:
        status = registry.status(dataset_identity(dataset_id="patients"))
        assert status.spent_epsilon == pytest.approx(report["epsilon_spent"], rel=1e-3)
        registry.set_budget(dataset_identity(dataset_id="patients"), epsilon=3.5, delta=1e-5)
    finally:
        registry.close()
    again = {"__name__": "__docs__", "run_folder": tmp_path / "again", **_parts()}
    with pytest.raises(BudgetExhaustedError):
        exec(compile(_budget_example(), "docs/budget.md", "exec"), again)
    assert "private_loader" not in again and not (tmp_path / "again").exists()
    assert len(_runs("patients")) == 1
