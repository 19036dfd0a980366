"""Adversarial review revJ, J3: a ``sql:`` source's public refusals come before any job's charge.

A ``--query`` on a database whose column check would run it over the rows (MySQL, PostgreSQL through
another driver than psycopg 3, ...) is refused on the URL alone; ``veil schema infer`` and a table run
of ``veil train`` refused it for free, but ``veil synth`` and a text run of ``veil train`` refused it
after the charge (ε burnt on a typo, a run recorded). Now every job makes these refusals through
:func:`veil.data.check_sql_request`, run by :func:`veil.pipeline.private_data.open_account` before the
registry is opened (and earlier by the jobs' own declaration checks).

Planted (each seen to fail): drop the call from :func:`~veil.pipeline.private_data.open_account`
and synth's two cases fail (synth has no earlier check); drop it from
:func:`veil.pipeline.data._check_text_request` and
``test_a_text_run_checks_the_url_with_its_declarations`` fails; make
:func:`~veil.data.check_sql_request` return at once and every case fails but ``schema infer``'s (its
column check refuses the query before the charge on its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from _budget_cli import cli
from veil.errors import ConfigError, DataError

URL = "sql:mysql+pymysql://u@127.0.0.1:1/db"
QUERY = "select a, y from t"
SCHEMA = (
    'reviewed = true\n[columns.a]\ntype = "numeric"\nbounds = [0, 10]\n'
    '[columns.y]\nrole = "target"\nclasses = ["0", "1"]\n'
)


def _minilm() -> str:
    from test_hf_minilm_probe import _minilm

    return f"hf:{_minilm()}"


def _args(job: str, folder: Path) -> list[str]:
    schema = folder / "s.toml"
    schema.write_text(SCHEMA)
    out = ["--out", str(folder / "run")]
    return {
        "train": ["train", "--dataset", URL, "--query", QUERY, "--schema", str(schema), "--epsilon", "1",
                  *out],
        "train-text": ["train", "--dataset", URL, "--query", "select t, y from x", "--model", _minilm(),
                       "--text-column", "t", "--target", "y", "--classes", "0,1", "--epsilon", "1", *out],
        "synth": ["synth", "--dataset", URL, "--query", QUERY, "--schema", str(schema), "--epsilon", "1",
                  "--rows", "10", *out],
        "federated": ["federated", "--mode", "record-level", "--dataset", URL, "--query", QUERY, "--schema",
                      str(schema), "--clients", "3", "--rounds", "1", "--epsilon", "4", "--delta", "1e-3",
                      *out],
        "schema-infer": ["schema", "infer", URL, "--query", QUERY, "--target", "y", "--epsilon", "1",
                         "--out", str(folder / "s2.toml")],
    }[job]  # fmt: skip


def _no_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "budget", "show", "--json")
    assert code == 0
    assert json.loads(out)["datasets"] == []


@pytest.mark.parametrize("job", ["train", "train-text", "synth", "federated", "schema-infer"])
def test_a_bad_query_url_is_refused_before_any_charge(
    job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, *_args(job, tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot have its columns checked" in err and "Traceback" not in err
    _no_run(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("job", ["train-text", "synth"])
def test_a_password_in_the_url_is_refused_before_any_charge(
    job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other URL-only refusal of the same helper: a password would be written to the run folder."""
    args = [
        "sql:postgresql+psycopg://u:hunter2@127.0.0.1:1/db" if a == URL else a for a in _args(job, tmp_path)
    ]
    code, _, err = cli(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "password" in err and "hunter2" not in err
    _no_run(capsys)


def test_a_text_run_checks_the_url_with_its_declarations() -> None:
    """``veil train``/``veil tune`` refuse a text run's bad URL in :func:`check_declarations`, with the
    other public mistakes, before the model is loaded or the registry opened."""
    from veil.config import make_config
    from veil.pipeline.data import check_declarations

    cfg = make_config(
        {"dataset": URL, "query": QUERY, "model": _minilm(), "text_column": "t", "target": "y",
         "classes": ["0", "1"]},
        source="test",
    )  # fmt: skip
    with pytest.raises(DataError, match="cannot have its columns checked"):
        check_declarations(cfg)
    password = "sql:postgresql+psycopg://u:pw@h/db"
    cfg = cfg.model_copy(update={"dataset": password, "query": None, "table": "x"})
    with pytest.raises(ConfigError, match="password"):
        check_declarations(cfg)


def test_the_helper_passes_what_it_does_not_refuse() -> None:
    from veil.data import check_sql_request

    check_sql_request("csv:/nowhere.csv", query=QUERY)  # not SQL: nothing to say
    check_sql_request("sql:sqlite:///x.db", query=QUERY)  # SQLite checks a query without rows
    check_sql_request("sql:postgresql+psycopg://u@h/db", query=QUERY)  # libpq's describe
    check_sql_request("sql:mysql+pymysql://u@h/db")  # a table, no query
