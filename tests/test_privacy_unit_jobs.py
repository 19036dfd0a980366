"""Jobs that do not protect privacy units refuse one before a private row is read, in veil's error
format (value, why, fix), exit 2, nothing written and nothing charged: ``veil pate`` and ``veil
audit`` (on a dataset the registry records with a unit, or a unit in their settings), ``veil train
--nproc-per-node`` with a unit (before any rank starts), and ``veil train --audit`` with a
unit (before the run's stand-in is reserved). (``--stream`` with a unit is supported:
tests/test_privacy_unit_stream.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

from _budget_cli import cli as _cli
from _budget_cli import show as _show
from test_privacy_unit_train import FAST, SCHEMA, visits


@pytest.fixture
def table(tmp_path: Path) -> dict[str, str]:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    visits(tmp_path / "visits.csv", people=60)
    (tmp_path / "schema.toml").write_text(SCHEMA)
    pq.write_table(pcsv.read_csv(tmp_path / "visits.csv"), tmp_path / "visits.parquet")
    return {
        "csv": f"csv:{tmp_path / 'visits.csv'}",
        "parquet": f"parquet:{tmp_path / 'visits.parquet'}",
        "schema": str(tmp_path / "schema.toml"),
    }


@pytest.fixture
def no_row_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of a table's rows (the one encoder every table job goes through) fails the test."""
    import veil.tables.encoder as encoder

    def no_read(*_: object, **__: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(encoder.TableEncoder, "encode_batches", no_read)


def test_pate_on_a_unit_dataset_is_refused_before_reading(
    table: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    no_row_read: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import veil.data.tabular as tabular

    def no_read(*_: object, **__: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(tabular, "load_user", no_read)  # how pate reads a csv: with --target
    spec = ("--dataset", table["csv"], "--epsilon", "8", "--delta", "1e-5", "--privacy-unit", "patient_id")
    assert _cli(capsys, "budget", "set", *spec)[0] == 0
    import numpy as np

    np.save(tmp_path / "pool.npy", np.zeros((20, 2), dtype=np.float32))
    out = tmp_path / "pate"
    code, _, err = _cli(capsys, "pate", "--dataset", table["csv"], "--target", "outcome",
                        "--public-data", str(tmp_path / "pool.npy"), "--classes", "no,yes",
                        "--teachers", "4", "--aggregator", "gnmax", "--sigma", "6", "--out", str(out),
                        "--json")  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "privacy_unit" in err, err
    assert "add --privacy-unit patient_id" in err  # the fix, in veil.errors' format
    assert not out.exists() and _show(capsys, table["csv"])["runs"] == []


def test_audit_with_a_unit_is_refused_before_reading(
    table: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path, no_row_read: None
) -> None:
    config = tmp_path / "audit.toml"
    config.write_text(
        f'dataset = "{table["csv"]}"\ntable_schema = "{table["schema"]}"\nprivacy_unit = "patient_id"\n'
    )
    out = tmp_path / "audit"
    code, _, err = _cli(capsys, "audit", str(config), "--out", str(out), "--json")
    assert code == 2 and err.count("\n") == 1 and "privacy_unit" in err and "drop --privacy-unit" in err, err
    assert not out.exists()


def test_train_across_ranks_with_a_unit_is_refused_before_any_rank_starts(
    table: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    no_row_read: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import veil.distributed.launch as launch

    def no_launch(*_: object, **__: object) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch_local", no_launch)
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "--dataset", table["csv"], "--schema", table["schema"], *FAST,
                        "--privacy-unit", "patient_id", "--nproc-per-node", "2",
                        "--out", str(out))  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "--nproc-per-node" in err, err
    assert not out.exists() and _show(capsys, table["csv"])["runs"] == []


@pytest.mark.parametrize(("flag", "source"), [("--audit", "csv")])
def test_train_audit_with_a_unit_is_refused_with_nothing_charged(
    table: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    no_row_read: None,
    flag: str,
    source: str,
) -> None:
    """Refused from the configuration alone, before the stand-in is reserved (planted: the check
    left in the data loader, after the reservation, leaves a charged run in the registry)."""
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "--dataset", table[source], "--schema", table["schema"], *FAST,
                        "--privacy-unit", "patient_id", flag, "--out", str(out))  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and flag in err, err
    assert not out.exists() and _show(capsys, table[source])["runs"] == []
