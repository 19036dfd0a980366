"""The pipeline's private-data path (veil.pipeline.private_data): a read charge stands; splits by record
(or unit key) alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from veil.accounting.events import Gaussian
from veil.pipeline.private_data import DataRef, data_ref, open_account, record_mask, record_positions
from veil.registry.store import BudgetRegistry


@pytest.mark.parametrize(("read", "status"), [(False, "released"), (True, "committed")])
def test_a_reservation_is_released_only_if_no_row_was_read(tmp_path: Path, read: bool, status: str) -> None:
    db = tmp_path / "b.db"
    account = open_account(DataRef("digits", dataset_id="d"), job="test", db=db)
    account.reserve([Gaussian(2.0)], "run-1", 1e-5)
    if read:
        account.reading()
    account.finish(None)  # the job stopped without releasing anything
    account.close()  # idempotent
    with BudgetRegistry(db) as registry:
        run = registry.run("run-1")
    assert run is not None and run.status == status
    if read:
        assert run.events == (Gaussian(2.0),)  # settled at its plan


def test_data_ref_reads_settings_and_treats_empty_as_none() -> None:
    ref = data_ref("csv:x.csv", {"dataset_id": "", "table": None, "data_dir": ""})
    assert ref == DataRef("csv:x.csv")
    assert data_ref("d", {"dataset_id": "people"}).dataset_id == "people"


def test_splits_depend_on_the_record_or_its_unit_alone() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    labels = [str(v) for v in rng.integers(0, 2, 200)]
    full = record_positions(x, labels, "veil.test", 0)
    assert np.array_equal(record_positions(x[50:], labels[50:], "veil.test", 0), full[50:])
    assert not np.array_equal(record_positions(x, labels, "veil.other", 0), full)  # one key per split
    units = [i // 4 for i in range(200)]  # four rows per unit: they land on one side together
    mask = record_mask(x, labels, 0.3, "veil.test", 0, units=units)
    assert all(len(set(mask[i : i + 4])) == 1 for i in range(0, 200, 4))
    assert 0.1 < mask.mean() < 0.5
