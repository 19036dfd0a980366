"""PATE end to end: partitions, teachers (parallel, resumable), the run, the report and the CLI.

The privacy analysis itself is tested in ``test_pate_analysis.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from veil.cli.main import main
from veil.errors import CheckpointError, ConfigError, DataError
from veil.pate.config import resolve_pate_config
from veil.pate.partition import check_public_shape, count_shared_rows, partition_teachers
from veil.pate.run import run_pate
from veil.pate.teachers import ModelRecipe, train_teachers


def _data(n: int = 300, d: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=n) > 0).astype(np.int64)
    return x, y


# -- partition -------------------------------------------------------------------------------------
def test_each_example_lands_in_one_teacher_and_a_removal_changes_one_teacher() -> None:
    x, y = _data()
    part = partition_teachers(x, y, 7, seed=3)
    assert part.assignment.shape == (300,) and part.sizes.sum() == 300
    assert set(np.unique(part.assignment)) == set(range(7))
    for i in (0, 150, 299):  # remove one example: every other example keeps its teacher
        keep = np.arange(300) != i
        again = partition_teachers(x[keep], y[keep], 7, seed=3)
        assert np.array_equal(again.assignment, part.assignment[keep])
    # adding an example changes nothing for the others either
    x2, y2 = np.vstack([x, x[:1] + 0.5]), np.append(y, 1)
    assert np.array_equal(partition_teachers(x2, y2, 7, seed=3).assignment[:300], part.assignment)


def test_groups_land_in_one_teacher_and_become_the_unit() -> None:
    x, y = _data()
    groups = np.repeat(np.arange(30), 10)
    part = partition_teachers(x, y, 5, seed=1, groups=groups)
    assert part.unit == "group" and part.num_units == 30
    for g in range(30):
        assert np.unique(part.assignment[groups == g]).size == 1
    with pytest.raises(DataError, match="group"):
        partition_teachers(x, y, 5, seed=1, groups=groups[:-1])


def test_public_rows_equal_to_private_rows_are_counted_and_a_wrong_shape_is_refused() -> None:
    x, _ = _data()
    public = np.vstack([np.random.default_rng(9).normal(size=(20, 5)).astype(np.float32), x[17:18], x[3:4]])
    assert count_shared_rows(x, public) == 2 and count_shared_rows(x, public[:20]) == 0
    check_public_shape(x, public)
    with pytest.raises(DataError, match="shape"):
        check_public_shape(x, public[:, :3])


# -- teachers --------------------------------------------------------------------------------------
def _recipe() -> ModelRecipe:
    return ModelRecipe("sklearn-logreg", (5,), 2, "table", None, seed=0)


def test_teachers_resume_after_an_interruption(tmp_path: Path) -> None:
    x, y = _data()
    part = partition_teachers(x, y, 6, seed=0)
    args = (x, y, part.assignment, 6, 2, x[:50], x[50:80], _recipe())
    first = train_teachers(*args, run_dir=tmp_path, fingerprint="a")
    assert first.resumed == 0 and first.public.shape == (6, 50)
    (tmp_path / "teachers" / "teacher_00002.npz").unlink()  # as if interrupted before teacher 2 finished
    again = train_teachers(*args, run_dir=tmp_path, fingerprint="a")
    assert again.resumed == 5
    assert np.array_equal(again.public, first.public) and np.array_equal(again.test, first.test)
    with pytest.raises(CheckpointError, match="another configuration"):
        train_teachers(*args, run_dir=tmp_path, fingerprint="b")


def test_teachers_in_parallel_processes_match_serial_training(tmp_path: Path) -> None:
    x, y = _data()
    part = partition_teachers(x, y, 4, seed=0)
    args = (x, y, part.assignment, 4, 2, x[:40], x[40:60], _recipe())
    serial = train_teachers(*args)
    parallel = train_teachers(*args, run_dir=tmp_path, fingerprint="p", workers=2)
    assert np.array_equal(serial.public, parallel.public)
    assert len(list((tmp_path / "teachers").glob("teacher_*.npz"))) == 4


# -- end to end ------------------------------------------------------------------------------------
def test_end_to_end_on_digits_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["pate", "--dataset", "digits", "--teachers", "20", "--aggregator", "gnmax", "--sigma", "6"]
    argv += [
        "--epsilon",
        "8",
        "--delta",
        "1e-5",
        "--queries",
        "150",
        "--seed",
        "1",
        "--out",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for key in (
        "epsilon",
        "epsilon_data_independent",
        "epsilon_data_dependent",
        "delta",
        "aggregator",
        "teachers",
        "queries_asked",
        "queries_answered",
        "randomness",
        "release_ready",
        "label_set",
    ):
        assert key in r
    private = {k: v for k, v in r.items() if k != "non_private"}
    for key in ("label_accuracy", "teacher_accuracy", "student_test_accuracy", "vote_margins"):
        assert key in r["non_private"] and key not in private  # non-private figures only there
    for key in ("n_private", "n_test", "public_private_duplicates", "sha256"):  # counted from private rows
        assert key in r["non_private"]["dataset"] and key not in r["dataset"]
    assert r["randomness"] == "secure" and r["release_ready"] is True
    assert r["label_set"]["source"] == "declared" and r["label_set"]["classes"] == [str(d) for d in range(10)]
    assert (
        r["pate"]["guarantee"] == "data-independent" and r["epsilon"] == r["epsilon_data_independent"] <= 8.0
    )
    assert 0 < r["queries_answered"] <= 150 and r["teachers"] == 20
    # Far above chance (0.1); secure noise varies run to run (0.595 seen once for the student).
    assert r["non_private"]["label_accuracy"] > 0.45 and r["non_private"]["student_test_accuracy"] > 0.45
    assert "whatever the data" in r["guarantee_statement"] and "stratified" in r["dataset"]["split"]
    for name in ("report.json", "report.html", "epsilon.png", "margins.png", "labels.npz", "student.model"):
        assert (out / name).stat().st_size > 0
    assert "data:image/png;base64," in (out / "report.html").read_text()
    labels = np.load(out / "labels.npz")
    assert labels["label"].size == r["queries_answered"]
    # Relabelling in the same folder would spend the budget twice: refused with exit 2.
    assert main(argv) == 2
    assert "second time" in capsys.readouterr().err


def test_confident_gnmax_with_groups_states_the_group_unit(tmp_path: Path) -> None:
    from veil.data import load_dataset

    n_private = load_dataset("digits", test_fraction=0.4, seed=0).n_train  # the run's private part
    groups = np.arange(n_private) // 4  # e.g. 4 images per writer
    r = run_pate(
        {
            "dataset": "digits",
            "teachers": 10,
            "aggregator": "confident-gnmax",
            "sigma": 2.0,
            "threshold": 7.0,
            "sigma1": 3.0,
            "epsilon": 10.0,
            "queries": 60,
            "out": str(tmp_path / "g"),
        },
        groups=groups,
    )
    assert r.privacy_unit == "group" and "group" in r.guarantee_statement
    assert r.queries_answered <= r.queries_asked <= 60
    assert r.epsilon_data_dependent is not None and r.data_dependent is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--aggregator", "majority-vote"], "aggregator='majority-vote'"),
        (["--epsilon", "0.01"], "even one query"),
        (["--budget", "data-dependent", "--aggregator", "lnmax"], "budget"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["pate", "--dataset", "digits", "--teachers", "10", "--out", str(tmp_path / "bad"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Fix:" in err and len(err.splitlines()) == 1


def test_config_file_precedence_and_unknown_keys(tmp_path: Path) -> None:
    toml = tmp_path / "pate.toml"
    toml.write_text('[pate]\ndataset = "digits"\nteachers = 25\naggregator = "lnmax"\n')
    cfg = resolve_pate_config(toml, {"teachers": 30, "epsilon": None})
    assert (cfg.teachers, cfg.aggregator, cfg.epsilon) == (30, "lnmax", 2.0)
    toml.write_text("[pate]\nteacher = 25\n")
    with pytest.raises(ConfigError, match="did you mean 'teachers'"):
        resolve_pate_config(toml)


def test_a_folder_of_trained_teachers_is_resumed_and_any_other_folder_refused(tmp_path: Path) -> None:
    import shutil

    settings = {"dataset": "digits", "teachers": 10, "sigma": 2.0, "epsilon": 10.0, "queries": 30}
    first = run_pate({**settings, "out": str(tmp_path / "a")})
    assert first.teachers_resumed == 0 and [c.name for c in first.checks] == [
        "target_epsilon_kept",
        "secure_randomness",
    ]  # no check on N: it is private for PATE (δ against 1/N is the internal note checks_on_n)
    assert all(c.passed for c in first.checks) and first.release_ready and first.checks_on_n == []
    from veil.pate.report import pate_checks

    over = first.model_copy(update={"epsilon": 10.5, "epsilon_data_independent": 10.5})
    assert [c.passed for c in pate_checks(over)] == [False, True]
    page = (tmp_path / "a" / "report.html").read_text()
    assert '<section class="internal">' in page
    internal = page[page.index('<section class="internal">') :]
    assert "Teacher accuracy" in internal and "Teacher accuracy" not in page[: len(page) - len(internal)]
    headings = ["The guarantee", "Result", "Verification checklist", "Parameters", "Plots", "Files"]
    positions = [page.index(f"<h2>{h}</h2>") for h in headings]  # the skeleton every job's page shares
    assert positions == sorted(positions)
    shutil.copytree(tmp_path / "a" / "teachers", tmp_path / "b" / "teachers")
    again = run_pate({**settings, "out": str(tmp_path / "b")})
    assert again.teachers_resumed == 10
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("an earlier result")
    with pytest.raises(ConfigError, match="not empty"):
        run_pate({**settings, "out": str(tmp_path / "c")})
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["notes.txt"]
