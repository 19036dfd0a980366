"""LoRA on a sentence-transformers folder: the mean-pooled classifier (``PooledClassifier``).

* ``build_text_classifier(..., "lora")`` picks it exactly when the folder declares mean pooling
  (``1_Pooling/config.json``), the model's own head otherwise;
* before any update (peft starts every ``B`` factor at zero) its logits equal the frozen head's
  (``FrozenTextEncoder`` features, times √H, through the same linear head): LoRA starts where ``head`` starts;
* per-sample clipping of its adapters and head equals a naive per-example loop (float64, ≤ 1e-6,
  half the examples clipped), and the norms agree.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from veil.clipping import PerSampleClipper  # noqa: E402
from veil.hf import (  # noqa: E402
    FrozenTextEncoder,
    LoraSettings,
    PooledClassifier,
    SequenceClassifier,
    apply_lora,
    build_text_classifier,
    declared_pooling,
    inspect_folder,
)

VOCAB, LABELS = 40, 3
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "movie", "not", "very"]


def _config() -> object:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-st")
    torch.manual_seed(0)
    config = _config()
    config.vocab_size = len(WORDS)
    transformers.BertModel(config).save_pretrained(path)
    transformers.BertTokenizer(
        vocab={w: i for i, w in enumerate(WORDS)}, model_max_length=16
    ).save_pretrained(path)
    return str(path)


def _declare(folder: str, mode: str | None) -> None:
    pooling = inspect_folder(folder).path / "1_Pooling"
    pooling.mkdir(exist_ok=True)
    settings = {f"pooling_mode_{m}_tokens": m == mode for m in ("cls", "mean", "max")}
    (pooling / "config.json").write_text(json.dumps({"word_embedding_dimension": 16, **settings}))


def _tokens(n: int = 6, length: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # padding in two of the examples
    mask[2, 6:] = 0
    ids = ids * mask
    return torch.stack([ids, mask], dim=1), torch.randint(0, LABELS, (n,), generator=g)


def test_the_folder_decides_the_head(folder: str) -> None:
    checked = inspect_folder(folder)
    assert declared_pooling(checked) is None  # no 1_Pooling: the model's own head
    assert isinstance(build_text_classifier(checked, 2, "lora"), SequenceClassifier)
    _declare(folder, "cls")
    assert declared_pooling(checked) == "cls"
    assert isinstance(build_text_classifier(checked, 2, "lora"), SequenceClassifier)
    _declare(folder, "mean")
    assert declared_pooling(checked) == "mean"
    model = build_text_classifier(checked, 2, "lora", LoraSettings(rank=2, targets=("query",)))
    assert isinstance(model, PooledClassifier)
    assert isinstance(build_text_classifier(checked, 2, "full"), SequenceClassifier)  # lora only
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert any(n.startswith("head.") for n in trainable)


def test_before_any_update_lora_is_the_frozen_head(folder: str) -> None:
    _declare(folder, "mean")
    checked = inspect_folder(folder)
    torch.manual_seed(0)
    model = build_text_classifier(checked, LABELS, "lora", LoraSettings(rank=2, targets=("query", "value")))
    assert isinstance(model, PooledClassifier)
    model.eval()
    frozen = FrozenTextEncoder(transformers.AutoModel.from_pretrained(folder))
    x, _ = _tokens()
    x = x.clamp_max(len(WORDS) - 1)
    with torch.no_grad():
        assert torch.allclose(model(x), model.head(frozen(x) * 16**0.5), atol=1e-5)  # √H, H = 16


def _pooled_lora() -> torch.nn.Module:
    torch.manual_seed(0)
    encoder = apply_lora(
        transformers.BertModel(_config()),
        LoraSettings(rank=3, alpha=6.0, targets=("query", "value", "dense")),
        "FEATURE_EXTRACTION",
    )
    for name, p in encoder.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # peft starts B at zero: give the adapters a gradient path
    return PooledClassifier(encoder, LABELS).double().eval()


def _naive(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, c: float):
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        norms.append(norm)
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, c / (norm + 1e-12))
    return params, total, norms


def test_clipped_sum_equals_naive_loop() -> None:
    model = _pooled_lora()
    x, y = _tokens()
    _, _, norms = _naive(model, x, y, 1e9)
    c = sorted(norms)[len(norms) // 2]  # half the examples are clipped
    params, want, naive_norms = _naive(model, x, y, c)
    clipper = PerSampleClipper(model, c)
    try:
        F.cross_entropy(model(x), y).backward()
        got_norms = clipper.accumulate()
        got = clipper.clipped_sum()
    finally:
        clipper.remove()
    assert [id(p) for p in clipper.parameters] == [id(p) for p in params]
    assert torch.allclose(got_norms, torch.tensor(naive_norms, dtype=got_norms.dtype), rtol=1e-9)
    num = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True)))
    assert num / math.sqrt(sum(float(b.square().sum()) for b in want)) <= 1e-6
    assert "LoraLinearRule" in {type(s.rule).__name__ for s in clipper._sites}
