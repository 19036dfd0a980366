"""``veil train --stream``: Poisson-sampled rows read from Parquet row groups, window by window.

Sampler: the windowed reader makes exactly the engine sampler's draws, every (row, step) inclusion is
Bernoulli(q) (seeded χ², stated false-failure rate; a sampler at 1.1·q is caught), the rows read are the
rows drawn, and memory stays inside the read budget on a file larger than it. Pipeline: a streamed run
uses the in-memory run's split, q and draws (seeded: the same weights), trains, predicts, resumes, is
charged to the registry before a row is read, and refuses what it cannot do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tables_support import gbsg2  # noqa: E402
from test_tables_sources import GBSG2_SCHEMA  # noqa: E402
from veil.cli.main import main  # noqa: E402
from veil.mechanisms.rng import make_source  # noqa: E402
from veil.sampling import PoissonBatchSampler  # noqa: E402
from veil.tables.encoder import TableEncoder  # noqa: E402
from veil.tables.sampler import ChunkedPoissonSampler  # noqa: E402
from veil.tables.schema import ColumnSpec, TableSchema  # noqa: E402
from veil.tables.stream import ParquetRows, WindowedSampler, parquet_rows, scan_parquet  # noqa: E402

N = 3000
FALSE_FAILURE = 1e-6
"""Each statistical check below fails a correct sampler with probability about this (seeded, so a
failure is reproducible; the three checks of one run together: ≤ 3e-6)."""


def _id_table(tmp_path: Path, n: int, group: int) -> tuple[Path, TableEncoder]:
    ids = np.arange(n, dtype=np.float64)
    path = tmp_path / f"ids{n}.parquet"
    pq.write_table(
        pa.table({"id": ids, "label": np.where(ids % 3 == 0, "a", "b")}), path, row_group_size=group
    )
    schema = TableSchema(
        (
            ColumnSpec("id", "numeric", bounds=(0.0, float(n - 1)), missing="error"),
            ColumnSpec("label", "categorical", "target", levels=("a", "b"), unknown="error"),
        ),
        reviewed=True,
    )
    return path, TableEncoder(schema)


def _ids(x: np.ndarray, n: int) -> np.ndarray:
    return np.rint((x[:, 0].astype(np.float64) + 1) / 2 * (n - 1)).astype(int)


def _stream(path: Path, encoder: TableEncoder, q: float, steps: int, seed: int, budget: int):
    """(file ids of each step's batch, the reader, the training positions): the read path of a run."""
    scan = scan_parquet(path, encoder, 0.2, seed=0)
    rows = ParquetRows(path, encoder, scan.positions)
    inner = _chunked(PoissonBatchSampler(len(rows), q, steps, make_source(False, seed)), 500)
    batches = []
    for indices, _ in WindowedSampler(inner, rows, budget).logical_batches():
        x, y = rows.fetch(indices)
        ids = _ids(x, parquet_rows(path))
        np.testing.assert_array_equal(ids, scan.positions[indices])  # the rows read are the rows drawn
        np.testing.assert_array_equal(y, np.where(ids % 3 == 0, 0, 1))
        batches.append(ids)
    return batches, rows, scan.positions


def _chunked(sampler: PoissonBatchSampler, chunk: int) -> ChunkedPoissonSampler:
    chunked = ChunkedPoissonSampler.like(sampler)
    chunked.chunk_rows = chunk  # several chunks per mask (production: 2^20 rows)
    return chunked


def _sampling_ok(batches: list[np.ndarray], positions: np.ndarray, q: float) -> bool:
    """χ² of per-row inclusion counts against Binomial(T, q), a z-test on the mean batch size and no
    bias between the first and last row groups; each at FALSE_FAILURE."""
    steps, n = len(batches), len(positions)
    counts = np.zeros(int(positions.max()) + 1, dtype=int)
    for ids in batches:
        counts[ids] += 1
    counts = counts[positions]
    crit = stats.norm.isf(FALSE_FAILURE / 2)
    z = (np.mean([len(b) for b in batches]) - q * n) / np.sqrt(q * (1 - q) * n / steps)
    observed = np.bincount(counts, minlength=40)[:40]
    expected = stats.binom.pmf(np.arange(40), steps, q) * n
    keep = expected >= 5
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    first, last = counts[: n // 5], counts[-(n // 5) :]
    bias = abs(first.mean() - last.mean()) / np.sqrt(steps * q * (1 - q) * (2 / (n // 5)))
    return bool(abs(z) < crit and chi2 < stats.chi2.isf(FALSE_FAILURE, keep.sum() - 1) and bias < crit)


def test_chunked_window_makes_the_engine_sampler_s_draws_in_its_order(tmp_path: Path) -> None:
    """The mask drawn in chunks and the steps drawn ahead per window: the engine sampler's very draws."""
    path, encoder = _id_table(tmp_path, N, 700)
    rows = ParquetRows(path, encoder, scan_parquet(path, encoder, 0.2, seed=0).positions)
    plain = list(PoissonBatchSampler(len(rows), 0.05, 30, make_source(False, 9)).logical_batches())
    inner = _chunked(PoissonBatchSampler(len(rows), 0.05, 30, make_source(False, 9)), 333)
    windowed = list(WindowedSampler(inner, rows, 400).logical_batches())
    assert [b for b, _ in windowed] == [b for b, _ in plain]
    assert [t for _, t in windowed] == [t for _, t in plain]  # resume tokens too
    assert 1 < rows.stats.windows < 30  # several steps per window, several windows


def test_inclusion_is_bernoulli_q_per_row_and_step(tmp_path: Path) -> None:
    path, encoder = _id_table(tmp_path, N, 700)
    batches, rows, positions = _stream(path, encoder, 0.02, 400, seed=5, budget=600)
    assert len(batches) == 400 and rows.stats.windows > 20  # many passes over the file
    assert _sampling_ok(batches, positions, 0.02)


def test_a_sampler_at_1_1_q_is_caught(tmp_path: Path) -> None:
    """The same check rejects a sampler whose inclusion probability is 10 % too high."""
    path, encoder = _id_table(tmp_path, N, 700)
    batches, _, positions = _stream(path, encoder, 0.02 * 1.1, 400, seed=5, budget=600)
    assert not _sampling_ok(batches, positions, 0.02)


def test_memory_stays_inside_a_read_budget_smaller_than_the_file(tmp_path: Path) -> None:
    """20,000 rows, a budget of 1,500 sampled rows: what is held at once (a window's rows, plus the row
    group being read) stays under budget + one row group, far below the file."""
    n, group, budget = 20_000, 1000, 1500
    path, encoder = _id_table(tmp_path, n, group)
    batches, rows, _ = _stream(path, encoder, 0.02, 40, seed=1, budget=budget)
    assert len(batches) == 40 and rows.stats.windows >= 10
    assert rows.stats.peak_rows <= budget + group < n / 5
    assert max(rows.stats.window_steps) <= budget // 200  # B ≈ 320: at most 4 steps fit


def test_the_streamed_split_is_the_in_memory_split(tmp_path: Path) -> None:
    from veil.data import load_dataset

    (tmp_path / "s.toml").write_text(GBSG2_SCHEMA)
    path = tmp_path / "g.parquet"
    pq.write_table(__import__("pyarrow.csv").csv.read_csv(gbsg2()), path, row_group_size=100)
    data = load_dataset(f"parquet:{path}", schema=str(tmp_path / "s.toml"), seed=3)
    encoder = data.encoder
    scan = scan_parquet(path, encoder, 0.2, seed=3)
    x, y = ParquetRows(path, encoder, scan.positions).fetch(np.arange(len(scan.positions)))
    np.testing.assert_array_equal(x, data.x_train)
    np.testing.assert_array_equal(y, data.y_train)
    assert scan.n_test == data.n_test and np.array_equal(scan.x_test, data.x_test)


def test_a_direct_read_returns_unsorted_and_repeated_rows_in_the_order_asked(tmp_path: Path) -> None:
    path, encoder = _id_table(tmp_path, 400, 50)
    scan = scan_parquet(path, encoder, 0.2, seed=0)
    rows = ParquetRows(path, encoder, scan.positions)
    indices = [7, 3, 250, 3, len(rows) - 1, 0, 7]
    x, y = rows.fetch(indices)  # nothing loaded: read directly from the file
    ids = _ids(x, 400)
    np.testing.assert_array_equal(ids, scan.positions[indices])
    np.testing.assert_array_equal(y, np.where(ids % 3 == 0, 0, 1))
    assert rows.stats.direct_reads == 1


# -- the pipeline -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pyarrow.csv as pcsv

    folder = tmp_path_factory.mktemp("stream")
    (folder / "schema.toml").write_text(GBSG2_SCHEMA)
    pq.write_table(pcsv.read_csv(gbsg2()), folder / "g.parquet", row_group_size=100)  # 7 row groups
    return {"data": folder / "g.parquet", "schema": folder / "schema.toml"}


ARGS = ["--epochs", "2", "--epsilon", "3", "--reproducible", "--json"]


def _train(table: dict[str, Path], out: Path, *extra: str) -> dict:
    code = main(
        ["train", "--dataset", f"parquet:{table['data']}", "--schema", str(table["schema"]),
         *ARGS, "--out", str(out), *extra]
    )  # fmt: skip
    assert code == 0
    return json.loads((out / "report.json").read_text())


def test_a_streamed_run_is_the_in_memory_run_and_predicts(
    table: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seeded, a streamed run draws the same batches of the same rows as the in-memory run: same weights."""
    import torch

    streamed = _train(table, tmp_path / "s", "--stream", "--stream-rows", "400")
    memory = _train(table, tmp_path / "m", "--no-baseline")
    capsys.readouterr()
    for key in ("sampling_rate", "steps", "epsilon_spent", "noise_multiplier"):
        assert streamed[key] == memory[key]
    assert streamed["dataset"] == memory["dataset"]
    info = streamed["streaming"]
    assert info["row_groups"] == 7 and info["windows"] >= 2 and info["peak_rows_held"] <= 400 + 100
    assert streamed["non_private"]["baseline_test_accuracy"] is None
    assert "streaming" in streamed["non_private"]["labelled_elsewhere"]  # counts of the realised batches
    assert all(c["passed"] for c in streamed["checks"] if c["name"] != "secure_randomness")
    a = torch.load(tmp_path / "s" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    preds = tmp_path / "p.csv"
    spec = f"parquet:{table['data']}"
    code = main(["predict", str(tmp_path / "s"), "--dataset", spec, "--out", str(preds)])
    assert code == 0 and len(preds.read_text().splitlines()) == 686 + 1


def test_a_streamed_run_resumes_after_a_crash(
    table: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.accounting.ledger import Ledger
    from veil.pipeline import loop
    from veil.training import train

    out = tmp_path / "r"
    real = loop.update_ema
    calls = []

    def crash(*args: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # after the third step's update, before its checkpoint
        real(*args)  # type: ignore[arg-type]

    config = {
        "dataset": f"parquet:{table['data']}",
        "table_schema": str(table["schema"]),
        "stream": True,
        "epochs": 3,
        "reproducible": True,
        "checkpoint_every": 2,
        "out": str(out),
        "progress": False,
    }
    monkeypatch.setattr(loop, "update_ema", crash)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    monkeypatch.setattr(loop, "update_ema", real)
    ledger = Ledger.open(out / "ledger.jsonl", repair=True)
    ledger.close()
    assert ledger.steps == 3
    report = train(resume=out, progress=False)
    assert report.resumes == 1 and report.steps == report.steps_planned and report.streaming is not None


def test_the_registry_refuses_a_spent_dataset_before_the_file_is_scanned(
    table: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from veil.accounting.events import Laplace
    from veil.registry.charge import DatasetCharge
    from veil.tables import stream

    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("a row was read")

    spec = f"parquet:{table['data']}"
    earlier = DatasetCharge.before_reading(spec, job="train")  # an earlier run spent ε = 1
    earlier.reserve([Laplace(1.0)], "earlier", delta=1e-6)
    earlier.settle([Laplace(1.0)])
    earlier.close()
    assert main(["budget", "set", "--dataset", spec, "--epsilon", "0.9", "--delta", "1e-6"]) == 0
    monkeypatch.setattr(stream, "scan_parquet", no_scan)
    code = main(["train", "--dataset", spec, "--schema", str(table["schema"]), "--stream", *ARGS,
                 "--out", str(tmp_path / "x")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "budget" in err and not (tmp_path / "x").exists(), err


@pytest.mark.parametrize(
    ("dataset", "extra", "env", "match"),
    [
        ("csv", ["--stream"], None, "Parquet file"),
        ("parquet", ["--stream", "--audit"], None, "audit"),
        ("parquet", ["--stream", "--model", "rff"], None, "fixed feature front"),
        ("parquet", [], "1000", "pass --stream"),  # an in-memory load that would not fit
    ],
)
def test_refusals_are_one_line_exit_2_nothing_written(
    table: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
    dataset: str, extra: list[str], env: str | None, match: str,
) -> None:  # fmt: skip
    if env is not None:
        monkeypatch.setenv("VEIL_MEMORY_BYTES", env)
    spec = f"csv:{gbsg2()}" if dataset == "csv" else f"parquet:{table['data']}"
    code = main(["train", "--dataset", spec, "--schema", str(table["schema"]), *ARGS,
                 "--out", str(tmp_path / "x"), *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()


def test_a_job_that_needs_the_table_in_memory_refuses_stream(table: dict[str, Path]) -> None:
    """veil tune and veil audit prepare their data with prepare(cfg): given stream they would train on
    the few probe rows, so it is refused."""
    from veil.config import make_config
    from veil.errors import ConfigError
    from veil.pipeline.data import prepare

    cfg = make_config(
        {"dataset": f"parquet:{table['data']}", "table_schema": str(table["schema"]), "stream": True}
    )
    with pytest.raises(ConfigError, match="only veil train"):
        prepare(cfg)
    assert prepare(cfg, streaming=True).data.n_train == 544
