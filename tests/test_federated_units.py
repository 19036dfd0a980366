"""``veil federated --mode record-level --privacy-unit COLUMN``: silos by person, unit-level DP-SGD.

Privacy-critical properties, each with a test that fails when it breaks (planted errors named in
each test): every row of a person lies in one silo; each silo samples *units* at q = B / n_units;
a silo's step clips the mean of a unit's rows once (against a naive float64 loop); the report,
the registry and the δ check speak of units; whatever cannot be honoured is refused before reading.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("pyarrow")

from _budget_cli import cli as _cli
from _budget_cli import show as _show
from _fake_grid import InProcessGrid
from test_privacy_unit_train import SCHEMA, visits


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's engine runs the same ServerApp/ClientApp code on an in-process grid."""
    import veil.federated.run as run
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve

    def engine(s, cpus: int = 2) -> None:
        serve(InProcessGrid(make_client_app(s), s.clients), s)

    monkeypatch.setattr(run, "run_simulation_engine", engine)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("fed-units")
    visits(folder / "visits.csv", people=240)
    (folder / "schema.toml").write_text(SCHEMA)
    return {"csv": f"csv:{folder / 'visits.csv'}", "schema": str(folder / "schema.toml")}


def _args(table: dict[str, str], *extra: str) -> tuple[str, ...]:
    return ("federated", "--mode", "record-level", "--dataset", table["csv"], "--schema", table["schema"],
            "--model", "logreg", "--clients", "3", "--rounds", "2", "--local-steps", "2",
            "--local-batch", "16", "--epsilon", "4", "--delta", "1e-4", "--seed", "1", "--json",
            *extra)  # fmt: skip


def _settings(table: dict[str, str], **changes: object):
    from veil.federated.settings import FederatedSettings

    base = dict(mode="record-level", dataset=table["csv"], table_schema=table["schema"], clients=3,
                rounds=2, epsilon=4.0, delta=1e-4, model="logreg", seed=1, local_batch=16,
                local_steps=2, privacy_unit="patient_id")  # fmt: skip
    return FederatedSettings(**{**base, **changes})  # type: ignore[arg-type]


def test_every_row_of_a_person_lies_in_one_silo_and_a_person_moves_no_one_else(
    table: dict[str, str],
) -> None:
    """Planted "silo by row" (row_positions instead of the unit's hash): people span silos, caught."""
    from veil.federated.local import federation
    from veil.federated.units import silo_positions

    fed = federation(_settings(table))
    assert fed.units is not None
    owner = {}
    for k, rows in enumerate(fed.parts):
        for u in fed.units[rows]:
            assert owner.setdefault(int(u), k) == k, "a person's rows lie in two silos"
    assert len(owner) == len(np.unique(fed.units)) and len({*owner.values()}) == 3
    # Removing one person leaves every other row's position (so silo) unchanged: a function of the unit.
    units = fed.units
    gone = units != units[0]
    assert np.array_equal(silo_positions(units, 5)[gone], silo_positions(units[gone], 5))


def test_a_unit_level_federated_run_reports_people_and_samples_units(
    table: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path, in_process: None
) -> None:
    """q over units (planted: q = B / rows, caught by the silos' sampling rates), the report's
    privacy_unit section and guarantee, the registry's unit, and no id printed anywhere."""
    from veil.federated.local import federation

    out = tmp_path / "fl"
    code, stdout, err = _cli(capsys, *_args(table, "--privacy-unit", "patient_id", "--out", str(out)))
    assert code == 0, err
    report = json.loads(stdout)
    g = report["guarantee"]
    assert g["neighbouring"] == "add_or_remove_one_unit" and g["unit"] == "privacy unit"
    assert "each person" in g["statement"] and "whatever number of rows" in g["statement"]
    silos = g["silos"]
    fed = federation(_settings(table))
    for k in range(3):
        info = silos[f"silo-{k}"]
        units = len(np.unique(fed.units[fed.parts[k]]))
        assert info["units"] == units and "rows" not in info  # a silo's rows are not public then
        assert info["sampling_rate"] == pytest.approx(16 / units)  # B over the silo's units, not rows
    section = report["privacy_unit"]
    assert section["column"] == "patient_id" and section["units"] == len(np.unique(fed.units))
    assert section["max_rows_per_unit"] == 16 and section["rows_used_per_step"] == 16 * 16  # default K
    assert g["epsilon"] <= 4.0 * (1 + 1e-9)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["delta"]["passed"] and "n its units" in checks["delta"]["detail"]
    assert checks["budget"]["passed"] and checks["silo accounts agree"]["passed"]
    text = stdout + err + (out / "report.json").read_text() + (out / "report.html").read_text()
    assert "PATIENT-" not in text
    assert _show(capsys, table["csv"])["privacy_unit"] == "patient_id"


@pytest.mark.parametrize("clip", [1e6, 0.5, 0.05])
def test_a_silo_step_clips_the_mean_of_each_units_rows_once(table: dict[str, str], clip: float) -> None:
    """One noiseless step of a silo with every unit sampled (B = n_units, K ≥ every unit's rows)
    against a naive float64 loop: Σ_u clip_C(mean_{r∈u} ∇ℓ_r) / B. Planted "clip per row" (no
    unit_ids passed to the engine) or "sum instead of mean": caught."""
    import torch
    from torch import nn

    from veil.federated.local import local_dpsgd

    rng = np.random.default_rng(3)
    sizes = [1, 3, 8, 2, 5, 8, 1, 4]
    units = np.repeat(np.arange(len(sizes)) * 7 + 11, sizes).astype(np.uint64)
    x = torch.from_numpy(rng.normal(size=(len(units), 4)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 2, len(units)))
    s = _settings(table, local_batch=len(sizes), local_steps=1, max_rows_per_unit=8, clip=clip, local_lr=1.0)
    torch.manual_seed(0)
    head = nn.Linear(4, 2)
    w0 = [p.detach().double().clone() for p in head.parameters()]
    local_dpsgd(head, x, y, s, 0.0, 1, units)
    got = torch.cat([(p.detach().double() - w).flatten() for p, w in zip(head.parameters(), w0, strict=True)])
    ref = nn.Linear(4, 2).double()
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w0, strict=True):
            p.copy_(w)
    total = torch.zeros_like(got)
    for u in np.unique(units):
        rows = torch.from_numpy(np.flatnonzero(units == u))
        grads = []
        for r in rows:
            ref.zero_grad()
            nn.functional.cross_entropy(ref(x[r : r + 1].double()), y[r : r + 1]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
        g = torch.stack(grads).mean(0)
        total += g * min(1.0, clip / float(g.norm()))
    expected = -1.0 * total / len(sizes)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        (("--privacy-unit", "patient_id", "--mode", "client-level"), "client-level guarantee"),
        (("--privacy-unit", "patient_id", "--partition", "dirichlet:0.5"), "partition"),
        (("--privacy-unit", "patient_id", "--max-rows-per-unit", "0"), "max_rows_per_unit"),
        (("--max-rows-per-unit", "4"), "no unit column"),
    ],
)
def test_what_a_unit_run_cannot_honour_is_refused_before_reading(
    table: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra: tuple[str, ...],
    word: str,
) -> None:
    import veil.federated.local as local

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("the dataset was read")

    local._federation.cache_clear()
    monkeypatch.setattr(local, "load_dataset", must_not_read)
    args = _args(table)
    if "--mode" in extra:
        args = tuple(a for a in args if a not in ("--mode", "record-level"))
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *args, *extra, "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and word in err, err
    assert not out.exists()
    assert _show(capsys, table["csv"])["runs"] == []


def test_without_a_schema_the_unit_is_refused_before_reading(
    table: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = [a for a in _args(table) if a not in ("--schema", table["schema"])]
    code, _, err = _cli(capsys, *args, "--target", "outcome", "--privacy-unit", "patient_id")
    assert code == 2 and "schema" in err and len(err.strip().splitlines()) == 1, err


def test_a_row_level_run_on_a_unit_dataset_is_refused_before_reading(
    table: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.federated.local as local

    spec = ("--dataset", table["csv"], "--epsilon", "8", "--delta", "1e-5", "--privacy-unit", "patient_id")
    assert _cli(capsys, "budget", "set", *spec)[0] == 0

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("the dataset was read")

    local._federation.cache_clear()
    monkeypatch.setattr(local, "load_dataset", must_not_read)
    out = tmp_path / "fl"
    code, _, err = _cli(capsys, *_args(table), "--out", str(out))
    assert code == 2 and "--privacy-unit patient_id" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and _show(capsys, table["csv"])["runs"] == []


def test_delta_is_checked_against_the_smallest_silos_units_and_a_refusal_after_reading_is_charged(
    table: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path, in_process: None
) -> None:
    """δ ≥ 1/n_units of the smallest silo is refused (exit 2, nothing written); the data was read
    under the stand-in, which stays charged (as veil train). δ = 0.5/n_units, above 1/rows, runs:
    N counts units (planted: counting rows refuses it)."""
    from veil.federated.local import federation

    fed = federation(_settings(table))
    units = min(fed.records(k) for k in range(3))
    rows = min(len(p) for p in fed.parts)
    assert 0.5 / units >= 1.0 / rows
    for delta, refused in ((1.5 / units, True), (0.5 / units, False)):
        args = [a if a != "1e-4" else f"{delta:.6g}" for a in _args(table, "--privacy-unit", "patient_id")]
        out = tmp_path / f"fl-{refused}"
        code, _, err = _cli(capsys, *args, "--out", str(out))
        if refused:
            assert code == 2 and f"n = {units} units" in err and len(err.strip().splitlines()) == 1, err
            assert not out.exists()
            (run,) = _show(capsys, table["csv"])["runs"]
            assert run["status"] == "committed" and run["epsilon"] == pytest.approx(4.0, rel=0.02)
        else:
            assert code == 0, err
