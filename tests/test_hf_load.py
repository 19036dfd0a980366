"""Model folders, text columns and the frozen-encoder head: clear refusals and exact features."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from veil.errors import ConfigError, DataError  # noqa: E402
from veil.hf import (  # noqa: E402
    FrozenTextEncoder,
    LoraSettings,
    SequenceClassifier,
    build_text_classifier,
    check_texts,
    inspect_folder,
    load_tokenizer,
    tokenize,
)
from veil.models import FixedFeaturesThenHead, fixed_features, split_fixed_front  # noqa: E402

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    *["the", "a", "good", "bad", "movie", "cars", "i", "love", "hate", "this", "is", "not"],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny BERT saved like a pretrained checkpoint: config, safetensors weights, tokenizer."""
    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    transformers.BertModel(config).save_pretrained(path)
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}, model_max_length=32)
    tokenizer.save_pretrained(path)
    return str(path)


def _copy_without(src: str, dst: os.PathLike[str], skip: set[str]) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in skip:
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
                b.write(a.read())
    return str(dst)


def test_import_veil_hf_loads_neither_transformers_nor_peft() -> None:
    code = (
        "import sys, veil, veil.hf; print(any(m in sys.modules for m in ('transformers', 'peft', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # veil.hf itself needs torch (its models are nn.Modules); transformers/peft load only on use
    code = "import sys, veil.hf; print(any(m in sys.modules for m in ('transformers', 'peft')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    code = "import sys, veil; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_folder_checks(folder: str, tmp_path) -> None:
    checked = inspect_folder(folder)
    model = transformers.BertModel.from_pretrained(folder)
    assert checked.parameters == sum(p.numel() for p in model.parameters())
    assert checked.counted_from == "safetensors header"
    with pytest.raises(ConfigError, match="no such folder"):
        inspect_folder(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no weights"):
        inspect_folder(_copy_without(folder, tmp_path / "no-weights", {"model.safetensors"}))
    with pytest.raises(ConfigError, match="no tokenizer"):
        inspect_folder(_copy_without(folder, tmp_path / "no-tok", {"tokenizer.json", "vocab.txt"}))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        inspect_folder(_copy_without(folder, tmp_path / "no-config", {"config.json"}))


def test_model_too_large_is_refused_before_loading(folder: str, tmp_path) -> None:
    """A header announcing 3·10¹⁰ parameters (no data behind it): refused from the header alone."""
    big = _copy_without(folder, tmp_path / "big", {"model.safetensors"})
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [200_000, 150_000], "data_offsets": [0, 120_000_000_000]}}
    ).encode()
    with open(os.path.join(big, "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
    checked = inspect_folder(big)
    assert checked.parameters == 30_000_000_000
    with pytest.raises(ConfigError, match=r"30,000\.0 M parameters .* GiB"):
        build_text_classifier(checked, 2, "lora")
    with pytest.raises(ConfigError, match="--fine-tune full"):
        build_text_classifier(inspect_folder(folder), 2, "full", memory_limit=1000)


def test_text_column_checks() -> None:
    assert check_texts(["a b", "c"]) == ["a b", "c"]
    with pytest.raises(DataError, match="numbers"):
        check_texts(np.array([1.0, 2.0]), "score")
    with pytest.raises(DataError, match="row 1 is empty"):
        check_texts(["fine", "   "])
    with pytest.raises(DataError, match="row 0 has no value"):
        check_texts([None, "x"])
    with pytest.raises(DataError, match="row 1 holds a int"):
        check_texts(["x", 3])


def test_tokenize_has_a_declared_fixed_shape(folder: str) -> None:
    tokenizer = load_tokenizer(inspect_folder(folder))
    x = tokenize(tokenizer, ["i love this movie", "bad"], max_length=8)
    assert x.shape == (2, 2, 8) and x.dtype == np.int64
    assert x[:, 1].sum(axis=1).tolist() == [6, 3]  # [CLS] + words + [SEP]
    with pytest.raises(ConfigError, match="at most 32 tokens"):
        tokenize(tokenizer, ["x"], max_length=64)


def test_head_mode_is_a_fixed_front_computed_once(folder: str) -> None:
    checked = inspect_folder(folder)
    torch.manual_seed(0)
    model = build_text_classifier(checked, 3, "head")
    front, head = split_fixed_front(model)
    assert front is not None and isinstance(model[1], FixedFeaturesThenHead)
    assert isinstance(model[1].features, FrozenTextEncoder)
    assert not list(front.parameters())  # nothing to train or clip in the front
    x = tokenize(load_tokenizer(checked), ["i love this movie", "bad", "this is not good at all"], 12)
    feats = fixed_features(front, x, chunk=2)
    assert feats.shape == (3, 16) and np.allclose(np.linalg.norm(feats, axis=1), 1, atol=1e-5)
    alone = np.concatenate([fixed_features(front, x[i : i + 1]) for i in range(3)])
    assert np.allclose(feats, alone, atol=1e-5)  # each text's features depend on that text alone
    model.train()
    assert not model[1].features.encoder.training  # deterministic whatever the mode
    with torch.no_grad():
        assert torch.allclose(model(torch.from_numpy(x)), head(torch.from_numpy(feats)), atol=1e-5)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_lora_and_full_modes(folder: str, mode: str) -> None:
    torch.manual_seed(0)
    model = build_text_classifier(inspect_folder(folder), 2, mode, LoraSettings(rank=2, targets=("query",)))
    assert isinstance(model, SequenceClassifier)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if mode == "lora":
        assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    else:
        assert len(trainable) == len(list(model.parameters()))
    x = torch.from_numpy(tokenize(load_tokenizer(inspect_folder(folder)), ["good movie", "bad"], 10))
    assert model(x).shape == (2, 2)
    with pytest.raises(ConfigError, match="lora_targets"):
        build_text_classifier(inspect_folder(folder), 2, "lora", LoraSettings(targets=("nowhere",)))


def test_model_too_large_is_foreseen_from_the_config(folder: str, tmp_path) -> None:
    """Without a safetensors header, the count comes from the config (embeddings + layers)."""
    big = _copy_without(folder, tmp_path / "big-config", {"model.safetensors"})
    with open(os.path.join(big, "pytorch_model.bin"), "wb") as fh:
        fh.write(b"not read")
    with open(os.path.join(big, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    config.update(hidden_size=8192, num_hidden_layers=96, intermediate_size=32768, vocab_size=50_000)
    with open(os.path.join(big, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    checked = inspect_folder(big)
    assert checked.counted_from == "config"
    # 96 layers × (4·8192² + 2·8192·32768) + (50,000 + positions)·8192 ≈ 7.8·10¹⁰ parameters
    assert 7.7e10 < checked.parameters < 7.9e10
    with pytest.raises(ConfigError, match=r"need about .* GiB to fine-tune with --fine-tune head"):
        build_text_classifier(checked, 2, "head")


def test_text_rows_apply_a_rule_to_each_row_and_refuse_no_value() -> None:
    from veil.text.tokens import text_rows

    texts, reason = text_rows(["a b", "   ", None, float("nan"), 3.0, b"\x01", "c"])
    assert texts == ["a b", "", "", "", "3", "01", "c"]
    assert reason.tolist() == [0, 2, 1, 1, 0, 0, 0]
    texts, reason = text_rows(np.array([1.5, 2.0]))
    assert texts == ["1.5", "2"] and not reason.any()
    with pytest.raises(DataError, match="shape"):
        text_rows(np.zeros((2, 2)))
