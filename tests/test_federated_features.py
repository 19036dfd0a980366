"""A fixed front's features, computed once per simulated run and shared by every client
(:mod:`veil.federated.features`, :func:`veil.federated.local.shared_features`).

Each test would fail if the sharing broke: a client computing its own features again shows in the
count of rows through the front; a client reading other rows (or a stale file) shows in the
comparison with its own per-client computation and in the trained model; a kept file shows in the
run folder after the run."""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from _fake_grid import InProcessGrid
from veil.cli.main import main
from veil.federated import features, local
from veil.federated.settings import FederatedSettings


def _settings(tmp_path: Path, model: str = "scatternet", mode: str = "client-level") -> FederatedSettings:
    return FederatedSettings(mode=mode, dataset="digits", clients=30, rounds=2, epsilon=3.0,  # type: ignore[arg-type]
                             delta=1e-5, sampling_rate=0.5, partition="dirichlet:0.5", model=model,
                             seed=3, out=str(tmp_path / "run"))  # fmt: skip


@pytest.fixture
def front_rows(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Rows through the fixed front, by caller: the shared file's writer, or anyone else (a client
    computing its own features, the server's test-set evaluator)."""
    counts: dict[str, list[int]] = {"shared": [], "other": []}

    def counter(name: str, real):  # type: ignore[no-untyped-def]
        def fixed_features(front, x, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name].append(len(x))
            return real(front, x, *args, **kwargs)

        return fixed_features

    monkeypatch.setattr(features, "fixed_features", counter("shared", features.fixed_features))
    monkeypatch.setattr(local, "fixed_features", counter("other", local.fixed_features))
    return counts


@pytest.fixture
def in_process_engine(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """``veil federated`` runs its ServerApp against an in-process grid of its ClientApps; records
    what the run folder's features sub-folder held while the clients ran."""
    from veil.federated import run
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve

    seen: list[dict] = []

    def engine(s: FederatedSettings, cpus: int = 2) -> None:
        folder = Path(s.out) / features.FEATURES_DIR
        files = sorted(folder.iterdir()) if folder.exists() else []
        seen.append({
            "files": [f.name for f in files],
            "modes": [stat.S_IMODE(f.stat().st_mode) for f in files],
            "folder_mode": stat.S_IMODE(folder.stat().st_mode) if folder.exists() else None,
        })  # fmt: skip
        with contextlib.suppress(Exception):
            serve(InProcessGrid(make_client_app(s), s.clients), s)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "run_simulation_engine", engine)
    return seen


def _federated(capsys: pytest.CaptureFixture[str], out: Path, model: str) -> dict:
    code = main(["federated", "--dataset", "digits", "--model", model, "--epsilon", "3", "--seed", "5",
                 "--clients", "40", "--clients-per-round", "20", "--rounds", "2",
                 "--partition", "dirichlet:0.5", "--out", str(out), "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["scatternet", "rff"])
def test_the_front_sees_every_training_row_once_per_run(
    model: str, in_process_engine: list[dict], front_rows: dict[str, list[int]], capsys, tmp_path: Path
) -> None:
    from sklearn.datasets import load_digits

    out = tmp_path / "run"
    report = _federated(capsys, out, model)
    assert report["finished"]
    n = len(load_digits().target)
    header = json.loads((out / "ledger.jsonl").read_text().splitlines()[0])
    fed = local.federation(FederatedSettings.from_run_config(header["settings"]))
    n_train, n_test = len(fed.data.x_train), len(fed.data.x_test)
    assert n_train + n_test == n
    # The shared file: every training row once (the shape probe passes none); no client computed
    # its own; the only other rows through the front are the server's test set, once.
    assert sum(front_rows["shared"]) == n_train
    assert front_rows["other"] == [n_test]
    # While the clients ran the file was there, owner-only; after the run nothing of it is left.
    (during,) = in_process_engine
    assert len(during["files"]) == 1 and during["files"][0].endswith(".npy")
    assert during["modes"] == [0o600] and during["folder_mode"] == 0o700
    assert not (out / features.FEATURES_DIR).exists()


def test_a_clients_shared_features_equal_its_own_computation(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    fed = local.federation(s)
    front, _ = local.build_network(s, fed.data)
    with local.shared_features(s) as path:
        assert path is not None and path.exists()
        for pid, rows in enumerate(fed.parts):
            x, y = local.partition_features(s, pid, front)
            x_own, y_own = local.client_features(s, rows, front)
            assert x.shape == x_own.shape and np.array_equal(x.numpy(), x_own.numpy()), pid
            assert np.array_equal(y.numpy(), y_own.numpy())
    assert not path.exists()


def test_another_front_or_other_data_never_reads_the_file(tmp_path: Path) -> None:
    """The key covers the front and the data: another model's (or dataset's) path differs."""
    scatter = local.shared_features_path(_settings(tmp_path, "scatternet"))
    rff = local.shared_features_path(_settings(tmp_path, "rff"))
    other = local.shared_features_path(_settings(tmp_path, "rff").replace(dataset="breast-cancer"))
    assert scatter is not None and rff is not None and other is not None
    assert len({scatter, rff, other}) == 3
    assert local.shared_features_path(_settings(tmp_path, "logreg")) is None  # no fixed front


def test_a_run_with_shared_features_trains_the_same_model_as_per_client_features(
    in_process_engine: list[dict], monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:
    shared = _federated(capsys, tmp_path / "shared", "scatternet")

    @contextlib.contextmanager
    def nothing_shared(s: FederatedSettings):  # type: ignore[no-untyped-def]
        yield None

    monkeypatch.setattr(local, "shared_features", nothing_shared)
    own = _federated(capsys, tmp_path / "own", "scatternet")
    assert in_process_engine[0]["files"] and not in_process_engine[1]["files"]
    a, b = np.load(tmp_path / "shared" / "model.npz"), np.load(tmp_path / "own" / "model.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
    assert shared["non_private"]["final_test_accuracy"] == own["non_private"]["final_test_accuracy"]


def test_a_failed_write_or_a_killed_run_leaves_no_private_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk after the first chunk left 1,024 rows' features in a .partial file (the review's
    find); a killed run's whole file stayed until a resume with the same key. Both are removed."""
    s = _settings(tmp_path, model="rff")
    real, calls = features.fixed_features, []

    def failing(front, x):  # the third call: after the blank probe and the first chunk
        calls.append(len(x))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(front, x)

    monkeypatch.setattr(features, "fixed_features", failing)
    with pytest.raises(OSError), local.shared_features(s):
        pass
    folder = tmp_path / "run" / features.FEATURES_DIR
    assert not folder.exists() or not any(folder.iterdir())
    monkeypatch.setattr(features, "fixed_features", real)
    stale = folder / "train-0123456789abcdef01234567.npy"
    folder.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"features of a killed run")
    with local.shared_features(s) as path:
        assert path is not None and path.exists() and not stale.exists()
    assert not folder.exists() or not any(folder.iterdir())
