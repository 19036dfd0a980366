"""Adversarial review of issue 24 (privacy unit) in ``veil federated --mode record-level``.

With a privacy unit only each silo's number of *units* is public by declaration (as ``veil train``
labels its training row count non-private: it depends on how many rows each person has). A silo's
row count must therefore reach neither the server (a separate party), nor the reports, nor the
global model (FedAvg's weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("pyarrow")

from _budget_cli import cli as _cli
from test_federated_units import _args, in_process, table  # noqa: F401 (fixtures)


def _walk(obj: object, path: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_a_silos_row_count_is_not_in_the_public_report_of_a_unit_run(
    table: dict[str, str],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    in_process: None,  # noqa: F811
) -> None:
    """Planted: drop the label (or the fix) and each silo's ``rows`` is published again."""
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *_args(table, "--privacy-unit", "patient_id", "--out", str(out)))
    assert code == 0, err
    full = json.loads((out / "report.json").read_text())
    silos = full["guarantee"]["silos"]
    assert all("units" in v for v in silos.values())
    public = json.loads((out / "release" / "report.json").read_text())
    leaked = [p for p, _ in _walk(public) if p.endswith(".rows") and ".silos." in p]
    assert not leaked, f"silo row counts in the public report: {leaked}"
    public_silos = public["guarantee"]["silos"]
    assert all(v["units"] == silos[k]["units"] for k, v in public_silos.items())
    # Nor in the internal report: the silo never sends its row count to the server with a unit.
    assert all("rows" not in v for v in silos.values())
    assert "n (rows; units with a privacy unit)" in (out / "report.html").read_text()


def test_the_global_model_averages_silos_by_their_units_not_their_rows(
    table: dict[str, str],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    in_process: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FedAvg weights each silo's model by its ``num-examples``. With a privacy unit the silos' row
    counts are not public (they depend on each person's rows): weighting by them makes the global
    model a function of un-noised private counts. The weight must be the silo's units (public by
    declaration, the n of its q). Planted: ``"num-examples": len(x)`` in the silo's reply fails it."""
    import numpy as np

    from veil.federated.local import federation
    from veil.federated.settings import FederatedSettings
    from veil.federated.strategy import SiloFedAvg

    seen: list[dict[int, float]] = []
    original = SiloFedAvg.aggregate_train

    def spy(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        result = original(self, server_round, replies)
        seen.append({int(m["partition-id"]): float(m["num-examples"]) for m in self.replies[server_round]})
        return result

    monkeypatch.setattr(SiloFedAvg, "aggregate_train", spy)
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *_args(table, "--privacy-unit", "patient_id", "--out", str(out)))
    assert code == 0, err
    header = json.loads((out / "ledger.jsonl").read_text().split("\n", 1)[0])
    fed = federation(FederatedSettings.from_run_config(header["settings"]))
    assert seen and all(len(r) == 3 for r in seen)
    for weights in seen:
        for pid, weight in weights.items():
            assert weight == len(np.unique(fed.units[fed.parts[pid]])) < len(fed.parts[pid])
