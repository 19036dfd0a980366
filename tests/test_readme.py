"""The README's command-line examples run as written, in order, on small files made here.

Every line of the README's "Command line" block is executed in-process (``veil.cli.main.main``) in a
fresh folder holding the files the examples name: ``patients.csv``, ``data.csv`` (with a text column),
``config.toml``, ``clinic.db`` (SQLite), ``big.parquet`` with ``big.toml``, ``new_rows.csv``,
``tweets.csv`` with a tiny BERT in ``./minilm``. The one manual step the README asks for — reviewing
the drafted ``schema.toml`` and setting ``reviewed = true`` — is done between the two lines that say so.
"""

from __future__ import annotations

import random
import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest

from veil.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    """The argument lists of the README's command-line block (continuation lines joined, comments cut)."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"### Command line\s*\n```\n(.*?)```", text, re.S)
    assert block is not None, "the README lost its command-line block"
    joined = block.group(1).replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
    commands = [c for c in commands if c]
    assert all(c[0] == "veil" for c in commands), commands
    return commands


def _files(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sqlalchemy

    g = np.random.default_rng(0)
    n = 400
    age = g.integers(20, 80, n)
    income = np.round(g.lognormal(10, 0.4, n), 2)
    job = g.choice(["clerk", "nurse", "farmer", "teacher"], n)
    outcome = np.where(age / 80 + (job == "nurse") * 0.4 + g.normal(0, 0.3, n) > 0.8, "yes", "no")
    rows = [f"{a},{j},{i},{o}" for a, j, i, o in zip(age, job, income, outcome, strict=True)]
    (root / "data.csv").write_text("age,job,income,outcome\n" + "\n".join(rows) + "\n")
    (root / "new_rows.csv").write_text(
        "age,job,income\n" + "\n".join(r.rsplit(",", 1)[0] for r in rows[:20]) + "\n"
    )
    (root / "patients.csv").write_text(
        "age,income,outcome\n"
        + "\n".join(f"{a},{i},{o}" for a, i, o in zip(age, income, outcome, strict=True))
        + "\n"
    )
    (root / "config.toml").write_text('dataset = "digits"\nepsilon = 3.0\n')
    engine = sqlalchemy.create_engine(f"sqlite:///{root / 'clinic.db'}")
    with engine.begin() as conn:
        conn.execute(
            sqlalchemy.text("CREATE TABLE visits (age INTEGER, job TEXT, income REAL, outcome TEXT)")
        )
        for a, j, i, o in zip(age, job, income, outcome, strict=True):
            conn.execute(
                sqlalchemy.text("INSERT INTO visits VALUES (:a, :j, :i, :o)"),
                {"a": int(a), "j": str(j), "i": float(i), "o": str(o)},
            )
    engine.dispose()
    pq.write_table(pa.table({"x1": g.normal(0, 1, 2000), "x2": g.normal(5, 2, 2000),
                             "label": g.choice(["a", "b"], 2000)}), root / "big.parquet")  # fmt: skip
    (root / "big.toml").write_text(
        'reviewed = true\n[columns.x1]\ntype = "numeric"\nbounds = [-5, 5]\n'
        '[columns.x2]\ntype = "numeric"\nbounds = [-5, 15]\n'
        '[columns.label]\nrole = "target"\nclasses = ["a", "b"]\n'
    )
    _tiny_bert(root)


def _tiny_bert(root: Path) -> None:
    import torch
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "great", "bad", "awful", "the", "day"]
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=128,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(root / "minilm")
    transformers.BertTokenizer(
        vocab={w: i for i, w in enumerate(words)}, model_max_length=128
    ).save_pretrained(root / "minilm")
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(120):
        pos = rng.random() < 0.5
        lines.append(
            f"the {rng.choice(['good', 'great'] if pos else ['bad', 'awful'])} day,{'pos' if pos else 'neg'}"
        )
    (root / "tweets.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_every_readme_command_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = readme_commands()
    assert len(commands) >= 20
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    timings = []
    for argv in commands:
        if argv[:3] == ["veil", "train", "--dataset"] and argv[3] == "csv:data.csv":
            schema = tmp_path / "schema.toml"  # "after review": the README's manual step
            schema.write_text(schema.read_text().replace("reviewed = false", "reviewed = true"))
        started = time.monotonic()
        code = main(argv[1:])
        _, err = capsys.readouterr()
        timings.append((round(time.monotonic() - started, 1), " ".join(argv[:4])))
        assert code == 0, f"{' '.join(argv)} exited {code}: {err.strip()[-500:]} (timings so far: {timings})"
    assert (tmp_path / "predictions.csv").is_file() and (tmp_path / "syn" / "synthetic.csv").is_file()
    print(timings)
