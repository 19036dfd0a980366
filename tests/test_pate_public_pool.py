"""``veil pate``'s public pool is data declared public (issue 23, item 6): ``--public-data``, or a built-in
benchmark's documented public split; a user dataset without ``--public-data`` is refused before a row
is read, and the student is fitted only on public rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from _budget_cli import cli


def _csv(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = (x[:, 0] > 0).astype(int)
    path = tmp_path / "d.csv"
    path.write_text(
        "a,b,c,label\n" + "\n".join(f"{r[0]},{r[1]},{r[2]},{t}" for r, t in zip(x, y, strict=True)) + "\n"
    )
    return path


def test_own_data_without_public_data_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.data as data

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(data, "load_dataset", must_not_read)
    spec = f"csv:{_csv(tmp_path)}"
    out = tmp_path / "p"
    code, _, err = cli(capsys, "pate", "--dataset", spec, "--target", "label", "--classes", "0,1",
                       "--teachers", "5", "--sigma", "1", "--epsilon", "10", "--delta", "1e-4",
                       "--queries", "10", "--out", str(out))  # fmt: skip
    assert code == 2 and "public" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    code, out_text, _ = cli(capsys, "budget", "show", "--dataset", spec, "--json")
    assert code == 0 and json.loads(out_text)["datasets"][0]["runs"] == []  # nothing charged


def test_student_is_fitted_only_on_declared_public_rows(tmp_path: Path) -> None:
    """With ``--public-data`` every row the student sees (queries and unlabelled pool) is a public row;
    with a built-in benchmark, every one is from its public (held-out) split, none from the charged
    training split."""
    from veil.data import load_dataset
    from veil.pate.config import make_pate_config
    from veil.pate.data import load_pate_data
    from veil.pate.partition import row_digests

    rng = np.random.default_rng(1)
    public = rng.normal(size=(50, 3))
    np.savez(tmp_path / "pub.npz", x=public)
    cfg = make_pate_config({"dataset": f"csv:{_csv(tmp_path)}", "target": "label", "classes": ["0", "1"],
                            "public_data": str(tmp_path / "pub.npz")})  # fmt: skip
    d = load_pate_data(cfg)
    allowed = set(row_digests(public.astype(d.x_pub.dtype)))
    assert set(row_digests(d.x_pub)) <= allowed and set(row_digests(d.x_queries)) <= allowed
    digits = load_pate_data(make_pate_config({"dataset": "digits"}))
    ds = load_dataset("digits", test_fraction=make_pate_config({}).holdout_fraction, seed=0)
    assert not set(row_digests(digits.x_pub)) & set(row_digests(ds.x_train))
    assert set(row_digests(digits.x_pub)) <= set(row_digests(ds.x_test))


def test_own_data_with_public_data_is_charged_before_a_private_row_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--public-data`` and ``--classes`` the plan's shape is public: the reservation (here over
    the budget) comes before the private rows are read."""
    import veil.pate.run as pate_run

    spec = f"csv:{_csv(tmp_path)}"
    np.savez(tmp_path / "pub.npz", x=np.random.default_rng(2).normal(size=(30, 3)))
    assert cli(capsys, "budget", "set", "--dataset", spec, "--epsilon", "1", "--delta", "1e-4")[0] == 0

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(pate_run, "load_pate_data", must_not_read)
    out = tmp_path / "p"
    code, _, err = cli(capsys, "pate", "--dataset", spec, "--target", "label", "--classes", "0,1",
                       "--public-data", str(tmp_path / "pub.npz"), "--teachers", "5", "--sigma", "1",
                       "--epsilon", "10", "--delta", "1e-4", "--out", str(out))  # fmt: skip
    assert code == 2 and "budget" in err and not out.exists()


def test_public_data_sharing_rows_with_the_private_data_is_used_and_counted_non_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--public-data`` is public by the user's declaration: rows equal to private rows (known only
    after reading both) are no refusal (issue 23, item 7); their count sits only in ``non_private``."""
    from veil.data import load_dataset

    data = _csv(tmp_path)
    spec = f"csv:{data}"
    private = load_dataset(spec, target="label", classes=["0", "1"], test_fraction=0.2, seed=0).x_train
    public = np.vstack([np.random.default_rng(2).normal(size=(30, 3)), private[[3, 7]]])
    np.savez(tmp_path / "pub.npz", x=public)
    out = tmp_path / "p"
    code, _, err = cli(capsys, "pate", "--dataset", spec, "--target", "label", "--classes", "0,1",
                       "--public-data", str(tmp_path / "pub.npz"), "--teachers", "5", "--sigma", "1",
                       "--epsilon", "10", "--delta", "1e-4", "--queries", "10", "--seed", "0",
                       "--out", str(out))  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["non_private"]["dataset"]["public_private_duplicates"] == 2
    assert "public_private_duplicates" not in report["dataset"]
    assert (
        "2 public rows" not in json.dumps(report["dataset"]) and "checked" not in report["dataset"]["split"]
    )


def test_an_empty_public_pool_is_refused_before_a_private_row_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The declared pool is public: its size is checked before reading (it used to be after)."""
    import veil.data as data

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(data, "load_dataset", must_not_read)
    spec = f"csv:{_csv(tmp_path)}"
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 3)))
    out = tmp_path / "p"
    code, _, err = cli(capsys, "pate", "--dataset", spec, "--target", "label", "--classes", "0,1",
                       "--public-data", str(tmp_path / "empty.npz"), "--teachers", "5", "--sigma", "1",
                       "--epsilon", "10", "--delta", "1e-4", "--out", str(out))  # fmt: skip
    assert code == 2 and "no example" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    code, out_text, _ = cli(capsys, "budget", "show", "--dataset", spec, "--json")
    assert code == 0 and json.loads(out_text)["datasets"][0]["runs"] == []  # nothing charged
