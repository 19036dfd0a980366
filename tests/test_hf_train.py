"""``veil train --model hf:DIR --text-column COL``: end to end on a tiny BERT folder and a small CSV."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from veil.cli.main import main  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS += ["the", "a", "good", "bad", "movie", "cars", "this", "is", "great", "awful", "love", "hate"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-train")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    transformers.BertModel(config).save_pretrained(root / "model")
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}, model_max_length=32)
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "reviews.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["review", "score", "label"])
        for _ in range(120):
            pos = rng.random() < 0.5
            words = rng.sample(["good", "great", "love"] if pos else ["bad", "awful", "hate"], 2)
            words += rng.sample(["the", "movie", "cars", "this", "is"], 3)
            rng.shuffle(words)
            writer.writerow([" ".join(words), rng.random(), "pos" if pos else "neg"])
    return root


def _train(files: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    args = [
        "train",
        "--model",
        f"hf:{files / 'model'}",
        "--dataset",
        f"csv:{files / 'reviews.csv'}",
        "--text-column",
        "review",
        "--target",
        "label",
        "--classes",
        "neg,pos",
        "--max-length",
        "10",
        "--delta",
        "1e-3",
        "--no-baseline",
        "--out",
        str(out),
        *extra,
    ]
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "mode",
    [["--fine-tune", "head"], ["--fine-tune", "lora", "--lora-rank", "2", "--lora-targets", "query,value"]],
)
def test_train_text_classifier(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    code, output = _train(files, tmp_path / "run", capsys, *mode, "--epochs", "2", "--json")
    assert code == 0, output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    assert report["epsilon_spent"] <= 3.0 + 1e-9
    assert report["preprocessing"]["method"] == "tokens"
    if mode[1] == "head":
        assert report["parameters"] == 16 * 2 + 2  # only the linear head is trained
    else:
        assert report["parameters"] > 16 * 2 + 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--text-column", "nope"], "no such column"),
        (["--fine-tune", "sideways"], "fine"),
        (["--table", "reviews"], "only a sql: source has tables"),
        (["--fine-tune", "head", "--lora-lr", "1e-3"], "lora_lr"),
    ],
)
def test_bad_text_inputs_exit_2_and_write_nothing(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, err = _train(files, tmp_path / "run", capsys, *extra)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_folder_without_weights_exits_2(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text((files / "model" / "config.json").read_text())
    args = ["train", "--model", f"hf:{empty}", "--dataset", f"csv:{files / 'reviews.csv'}"]
    args += ["--text-column", "review", "--target", "label", "--classes", "neg,pos"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no weights" in err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def sqlite_reviews(files: Path) -> Path:
    """The same reviews as a SQLite table (text, a real-valued score, a text label)."""
    import sqlite3

    db = files / "reviews.db"
    if not db.exists():
        with open(files / "reviews.csv", newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE reviews (review TEXT, score REAL, label TEXT)")
        values = [(r["review"], float(r["score"]), r["label"]) for r in rows]
        con.executemany("INSERT INTO reviews VALUES (?, ?, ?)", values)
        con.commit()
        con.close()
    return db


def _train_sql(
    files: Path, db: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, str]:
    args = ["train", "--model", f"hf:{files / 'model'}", "--dataset", f"sql:sqlite:///{db}"]
    args += ["--target", "label", "--classes", "neg,pos", "--max-length", "10", "--delta", "1e-3"]
    args += ["--no-baseline", "--out", str(out), *extra]
    code = main(args)
    return code, capsys.readouterr().err


def test_train_text_from_sqlite(
    files: Path, sqlite_reviews: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _train_sql(
        files, sqlite_reviews, tmp_path / "run", capsys, "--table", "reviews", "--text-column", "review",
        "--epochs", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["dataset"]["name"] == f"sql:sqlite:///{sqlite_reviews} table reviews"
    assert report["dataset"]["n_train"] + report["dataset"]["n_test"] == 120
    assert report["epsilon_spent"] <= 3.0 + 1e-9


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--query", "SELECT '  ' AS review, label FROM reviews", "--text-column", "review"], "examples"),
        (["--table", "nope", "--text-column", "review"], "no such table"),
    ],
)
def test_bad_sql_text_exits_2_and_writes_nothing(
    files: Path,
    sqlite_reviews: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    code, err = _train_sql(files, sqlite_reviews, tmp_path / "run", capsys, *extra)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def _folder_variant(files: Path, where: Path, kind: str) -> Path:
    """The model folder without its tokenizer, or with a safetensors header announcing 3·10¹⁰ parameters."""
    import shutil
    import struct

    shutil.copytree(files / "model", where)
    if kind == "no-tokenizer":
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
            (where / name).unlink(missing_ok=True)
    else:
        header = json.dumps(
            {"w": {"dtype": "F32", "shape": [200_000, 150_000], "data_offsets": [0, 120_000_000_000]}}
        ).encode()
        (where / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return where


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-tokenizer", "no tokenizer"),
        ("too-large", "30,000.0 M parameters"),
    ],
)
def test_bad_folders_and_texts_exit_2_and_write_nothing(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    model, data = _folder_variant(files, tmp_path / case, case), files / "reviews.csv"
    args = ["train", "--model", f"hf:{model}", "--dataset", f"csv:{data}", "--text-column", "review"]
    args += ["--target", "label", "--classes", "neg,pos", "--max-length", "10", "--delta", "1e-3"]
    args += ["--fine-tune", "lora", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_missing_blank_and_numeric_texts_are_rules_not_refusals(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After reading, no text stops the run: a blank or missing text drops its row (counted, a rule on
    that row alone), a number is read as its digits."""
    rows = (files / "reviews.csv").read_text(encoding="utf-8").splitlines()
    rows[4] = '"   ",0.5,pos'
    rows[7] = ",0.5,neg"
    rows[9] = "12.0,0.5,neg"  # read as the text "12.0"
    data = tmp_path / "texts.csv"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = ["train", "--model", f"hf:{files / 'model'}", "--dataset", f"csv:{data}", "--text-column"]
    args += ["review", "--target", "label", "--classes", "neg,pos", "--max-length", "10", "--delta", "1e-3"]
    args += ["--fine-tune", "head", "--epochs", "1", "--no-baseline", "--out", str(tmp_path / "run")]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rules = report["non_private"]["per_record_rules"]
    # the CSV reader reads an empty cell as "" (a database's NULL is rows_dropped_text_missing)
    assert rules["rows_dropped_text_empty"] == 2 and rules["rows_dropped_text_missing"] == 0
    assert report["dataset"]["n_train"] + report["dataset"]["n_test"] == 118


@pytest.mark.parametrize("case", ["max-length", "no-tokenizer"])
def test_model_folder_checks_come_before_the_charge(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """The model folder is public: a max_length beyond what the model reads and a folder without a
    tokenizer are refused before the stand-in is reserved (they were refused after, and stayed
    charged; found by the review)."""
    dataset_id = f"reviews-{case}"
    assert main(["budget", "set", "--dataset-id", dataset_id, "--epsilon", "5", "--delta", "1e-3"]) == 0
    model = files / "model" if case == "max-length" else _folder_variant(files, tmp_path / case, case)
    args = ["train", "--model", f"hf:{model}", "--dataset", f"csv:{files / 'reviews.csv'}", "--text-column"]
    args += ["review", "--target", "label", "--classes", "neg,pos", "--delta", "1e-4", "--dataset-id"]
    args += [
        dataset_id,
        "--max-length",
        "64" if case == "max-length" else "10",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 2
    capsys.readouterr()
    assert main(["budget", "show", "--dataset-id", dataset_id, "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)["datasets"]
    assert status["runs"] == []
    assert not (tmp_path / "run").exists()


def test_lora_lr_puts_the_adapters_in_their_own_group(files: Path) -> None:
    """``lora_lr``: peft's adapter weights at that rate, every other trained weight (the head) at ``lr``;
    together exactly the trained parameters. Without it, one group at ``lr``."""
    from veil.config import TrainConfig
    from veil.hf import LoraSettings, build_text_classifier, inspect_folder
    from veil.pipeline.model import make_optimizer

    model = build_text_classifier(
        inspect_folder(str(files / "model")), 2, "lora", LoraSettings(rank=2, targets=("query", "value"))
    )
    names = {id(p): n for n, p in model.named_parameters()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    base = {"dataset": "csv:x.csv", "model": f"hf:{files / 'model'}", "fine_tune": "lora"}
    for optimizer in ("adam", "sgd"):
        split = make_optimizer(TrainConfig(**base, optimizer=optimizer, lr=0.1, lora_lr=0.01), model)
        by_lr = {g["lr"]: {names[id(p)] for p in g["params"]} for g in split.param_groups}
        assert set(by_lr) == {0.01, 0.1}
        assert by_lr[0.01] and all("lora_" in n for n in by_lr[0.01])
        assert by_lr[0.1] and not any("lora_" in n for n in by_lr[0.1])  # the head
        assert by_lr[0.01] | by_lr[0.1] == trained
        one = make_optimizer(TrainConfig(**base, optimizer=optimizer, lr=0.1), model)
        assert [g["lr"] for g in one.param_groups] == [0.1]
        assert {names[id(p)] for p in one.param_groups[0]["params"]} == trained
