"""``veil train --stream``: the training pipeline on a Parquet table read window by window.

The data side is :mod:`veil.tables.stream` (design, guarantee and limits there and in docs/tables.md).
Here: the :class:`StreamedDataset` the pipeline sees (its training rows stay in the file; ``n_train`` is
the keyed split's count, so ``q = B/N_train`` and every check are the in-memory path's), the checks
that refuse what streaming cannot do before anything is written, and the loader's wiring: the engine's
own Poisson sampler, wrapped so that each window of steps is read in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veil.data import Dataset
from veil.errors import ConfigError

if TYPE_CHECKING:
    from veil.config import TrainConfig
    from veil.tables.stream import ParquetRows, StreamScan

__all__ = [
    "StreamedDataset",
    "check_streamable",
    "install_window",
    "load_streamed",
    "refuse_fixed_front",
    "refuse_too_large",
    "rows_dataset",
]


@dataclass
class StreamedDataset(Dataset):
    """A table whose training rows stay in the Parquet file.

    ``x_train``/``y_train`` hold only a few training rows (for the model checks); ``x_test``/``y_test``
    the first held-out rows (the test metrics); ``n_train``/``n_test`` count the whole split."""

    rows: ParquetRows | None = None
    scan: StreamScan | None = None
    budget_rows: int = 0

    @property
    def n_train(self) -> int:
        assert self.rows is not None
        return len(self.rows)

    @property
    def n_test(self) -> int:
        assert self.scan is not None
        return self.scan.n_test

    def summary(self) -> dict[str, Any]:
        """The report's ``streaming`` section: how the rows were read (no statistic of the data)."""
        assert self.rows is not None and self.scan is not None
        s = self.rows.stats
        return {
            "source": "parquet row groups, read by position per window of steps",
            "rows_in_file": self.scan.n_rows,
            "row_groups": self.scan.row_groups,
            "budget_rows": self.budget_rows,
            "windows": s.windows,
            "row_groups_read": s.groups_read,
            "rows_decoded": s.rows_decoded,
            "peak_rows_held": s.peak_rows,
            "evaluated_held_out_rows": len(self.y_test),
            "baseline": "not run: the non-private baseline needs the table in memory",
        }


def check_streamable(cfg: TrainConfig) -> None:
    """Refuse, before a row is read, what a streamed run cannot do."""
    from veil.distributed.runtime import rank_and_world

    if not cfg.dataset.startswith("parquet:") or cfg.table_schema is None:
        raise ConfigError(
            "dataset",
            cfg.dataset,
            "--stream reads the row groups of a Parquet file through its schema",
            "pass --dataset parquet:FILE --schema SCHEMA.toml (write a CSV or SQL table to Parquet first)",
        )
    if cfg.audit:
        raise ConfigError(
            "audit",
            True,
            "the one-run audit injects canaries into a table held in memory",
            "audit a streamed run's model with veil audit --run, or train without --stream",
        )
    if rank_and_world()[1] > 1:
        raise ConfigError(
            "stream", True, "streaming is not yet sharded across processes", "train in one process"
        )


def refuse_fixed_front(model: Any) -> None:
    """A model with a fixed feature front computes its features for the whole table once: refused."""
    from veil.models import split_fixed_front

    if split_fixed_front(model)[0] is not None:
        raise ConfigError(
            "model",
            "a fixed feature front",
            "its features are computed once for the whole training table, which --stream never holds",
            "use --model logistic or mlp with --stream",
        )


def refuse_too_large(cfg: TrainConfig) -> None:
    """An in-memory Parquet load whose encoded table would not fit is refused with the --stream hint."""
    from veil.tables.encoder import TableEncoder
    from veil.tables.schema import load_schema
    from veil.tables.sources import parse_source
    from veil.tables.stream import check_fits_in_memory

    assert cfg.table_schema is not None
    source = parse_source(cfg.dataset)
    check_fits_in_memory(source.location, TableEncoder(load_schema(cfg.table_schema)), source.describe())


def load_streamed(cfg: TrainConfig) -> StreamedDataset:
    """Scan the Parquet file once (encode, split, keep positions and samples): see veil.tables.stream."""
    import numpy as np

    from veil.tables.dataset import source_fingerprint
    from veil.tables.encoder import TableEncoder
    from veil.tables.schema import load_schema
    from veil.tables.sources import parse_source
    from veil.tables.stream import DEFAULT_BUDGET_ROWS, ParquetRows, scan_parquet

    check_streamable(cfg)
    assert cfg.table_schema is not None
    schema = load_schema(cfg.table_schema)
    schema.require_reviewed(cfg.table_schema)
    target = schema.require_target("training")
    if cfg.target is not None and cfg.target != target.name:
        raise ConfigError(
            "target",
            cfg.target,
            f"the schema's target column is {target.name}",
            "drop --target (the schema says which column is the label) or fix the schema",
        )
    source = parse_source(cfg.dataset)
    encoder = TableEncoder(schema)
    scan = scan_parquet(source.location, encoder, cfg.test_fraction, cfg.seed, unit_column=cfg.privacy_unit)
    provenance = 'released with DP (reviewed = "dp")' if schema.reviewed == "dp" else "declared public"
    return StreamedDataset(
        name=source.describe(),
        kind="table",
        x_train=scan.x_probe,
        y_train=scan.y_probe,
        x_test=scan.x_test,
        y_test=scan.y_test,
        classes=list(target.levels),
        sha256=source_fingerprint(cfg.dataset, None, None),
        preset="table",
        feature_names=list(encoder.feature_names),
        encoder=encoder,
        notes=[
            f"features encoded by the schema {cfg.table_schema}: {provenance}; streamed from "
            f"{scan.row_groups} row groups"
        ],
        classes_declared_by="the reviewed schema's target classes (public by declaration)",
        rows=ParquetRows(source.location, encoder, np.asarray(scan.positions)),
        scan=scan,
        budget_rows=cfg.stream_rows or DEFAULT_BUDGET_ROWS,
        units_train=scan.units,  # privacy units: every training row's unit key (not its id)
        unit_column=cfg.privacy_unit,
    )


def rows_dataset(data: StreamedDataset, batch_type: type) -> Any:
    """The map-style dataset the loader samples from: training rows by index, a batch per call.

    ``batch_type``: the loop's marker for a gathered batch (its collate function passes it as is)."""
    import torch

    assert data.rows is not None
    rows: ParquetRows = data.rows

    class StreamRows:
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = rows.fetch([i])
            return torch.from_numpy(x[0]), torch.from_numpy(y)[0]

        def __getitems__(self, indices: list[int]) -> list[Any]:
            x, y = rows.fetch(indices)
            return [batch_type((torch.from_numpy(x), torch.from_numpy(y)))]

    return StreamRows()


def install_window(loader: Any, data: StreamedDataset) -> None:
    """Read the engine loader's Poisson batches window by window: its sampler, chunked
    (:mod:`veil.tables.sampler`: the same draws in the same order), wrapped in a
    :class:`~veil.tables.stream.WindowedSampler`. A privacy-unit run keeps the engine's
    :class:`~veil.units.UnitPoissonSampler` itself (units sampled, at most K rows each), wrapped the
    same way: the streamed run draws exactly what the in-memory run draws."""
    from veil.sampling import PoissonBatchSampler
    from veil.tables.sampler import ChunkedPoissonSampler
    from veil.tables.stream import WindowedSampler
    from veil.units import UnitPoissonSampler

    chunker, inner = loader.batch_sampler, loader.logical_sampler
    assert data.rows is not None and hasattr(chunker, "logical") and chunker.logical is inner
    assert isinstance(inner, PoissonBatchSampler)  # one process, Poisson (check_streamable)
    # Privacy units: the engine's own unit sampler, unchanged (its mask is over units, not rows).
    drawn = inner if isinstance(inner, UnitPoissonSampler) else ChunkedPoissonSampler.like(inner)
    windowed = WindowedSampler(drawn, data.rows, data.budget_rows)
    chunker.logical = windowed
    loader.logical_sampler = windowed  # resume tokens: saved and restored through the same sampler
