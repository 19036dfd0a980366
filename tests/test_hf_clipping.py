"""DP-SGD on Hugging Face models with peft LoRA: exactness against naive per-example loops.

Tiny random-initialised BERT/GPT-2 models built from a config (no weights, no network). The
references are independent of the clipper: one example at a time through the model (eval mode),
or, with dropout, one ``autograd.grad`` per example's own loss term on the same batched graph
(so each example keeps the dropout mask it drew).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from veil.clipping import PerSampleClipper  # noqa: E402

try:  # where the rule lookup lives moved with the pipeline refactor
    from veil.clipping.lookup import rule_for
except ImportError:  # pragma: no cover
    from veil.clipping.registry import rule_for
from veil.engine import PrivacyEngine  # noqa: E402
from veil.hf import LoraSettings, apply_lora  # noqa: E402

VOCAB, LABELS = 40, 3


def _config(dropout: float = 0.0) -> object:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=LABELS,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        tie_word_embeddings=True,
    )


def _lora(model: torch.nn.Module, task: str, dropout: float = 0.0) -> torch.nn.Module:
    settings = LoraSettings(rank=3, alpha=6.0, targets=("query", "value", "dense"), dropout=dropout)
    return apply_lora(model, settings, task_type=task)


def _batch(n: int = 6, length: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # padding in two of the examples
    mask[2, 6:] = 0
    labels = torch.randint(0, LABELS, (n,), generator=g)
    return ids, mask, labels


def _classifier(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return _lora(transformers.BertForSequenceClassification(_config(dropout)), "SEQ_CLS", dropout).double()


def _classifier_with_adapter_bias() -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["query", "value", "dense"], lora_bias=True, task_type="SEQ_CLS"
    )
    model = peft.get_peft_model(transformers.BertForSequenceClassification(_config()), config).double()
    for name, p in model.named_parameters():
        if "lora_B" in name and name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.1)  # peft starts B (and its bias) at zero
    return model


def _masked_lm() -> torch.nn.Module:
    """LoRA on a BERT MLM whose decoder is tied to the word embeddings, the tied weight trainable."""
    torch.manual_seed(0)
    model = _lora(transformers.BertForMaskedLM(_config()), "TOKEN_CLS").double()
    base = model.get_base_model()
    tied = base.bert.embeddings.word_embeddings.weight
    assert base.cls.predictions.decoder.weight is tied
    tied.requires_grad_(True)
    return model


def _cls_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y)


def _mlm_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]: predict each token itself
    per_token = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    return ((per_token * mask).sum(dim=1)).mean()  # the mean over examples of per-example terms


def _naive_clipped_sum(model, loss_fn, batch, c):
    ids, mask, y = batch
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(len(ids)):
        grads = torch.autograd.grad(loss_fn(model, ids[i : i + 1], mask[i : i + 1], y[i : i + 1]), params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        norms.append(float(norm))
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, c / (float(norm) + 1e-12))
    return params, total, norms


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True)))
    return num / math.sqrt(sum(float(b.square().sum()) for b in want))


def _clipped_sum(model, loss_fn, batch, c):
    clipper = PerSampleClipper(model, c)
    try:
        loss_fn(model, *batch).backward()
        norms = clipper.accumulate()
        return clipper, clipper.clipped_sum(), norms
    finally:
        clipper.remove()


@pytest.mark.parametrize("kind", ["classifier", "adapter_bias", "masked_lm_tied"])
def test_clipped_sum_equals_naive_loop(kind: str) -> None:
    builders = {
        "classifier": _classifier,
        "adapter_bias": _classifier_with_adapter_bias,
        "masked_lm_tied": _masked_lm,
    }
    model = builders[kind]()
    loss_fn = _mlm_loss if kind == "masked_lm_tied" else _cls_loss
    model.eval()
    batch = _batch()
    _, _, norms = _naive_clipped_sum(model, loss_fn, batch, 1e9)
    c = sorted(norms)[len(norms) // 2]  # half the examples are clipped
    params, want, naive_norms = _naive_clipped_sum(model, loss_fn, batch, c)
    clipper, got, got_norms = _clipped_sum(model, loss_fn, batch, c)
    assert [id(p) for p in clipper.parameters] == [id(p) for p in params]
    assert torch.allclose(got_norms, torch.tensor(naive_norms, dtype=got_norms.dtype), rtol=1e-9)
    assert _relative(got, want) <= 1e-6
    # every adapted layer is clipped by the LoRA rule; the frozen base layers are not hooked at all
    rules = {type(s.rule).__name__ for s in clipper._sites}
    assert "LoraLinearRule" in rules
    hooked = {s.name for s in clipper._sites}
    assert not any(name.endswith("base_layer") for name in hooked)


def test_frozen_parameters_cost_nothing_and_stay_untouched() -> None:
    model = _classifier()
    clipper = PerSampleClipper(model, 1.0)
    try:
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        assert {id(p) for p in clipper.parameters} == trainable
        _cls_loss(model, *_batch()).backward()
        clipper.accumulate()
        assert all(p.grad is None for p in model.parameters())  # no summed gradient computed for any
    finally:
        clipper.remove()


def test_dropout_masks_stay_per_example() -> None:
    """Train mode (hidden, attention and LoRA dropout): each example's gradient under its own mask."""
    model = _classifier(dropout=0.2)
    model.get_base_model()  # peft wraps it; dropout modules are live in train mode
    model.train()
    batch = _batch(seed=3)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(11)
    ids, mask, y = batch
    logits = model(input_ids=ids, attention_mask=mask).logits
    per_example = [
        torch.autograd.grad(F.cross_entropy(logits[i : i + 1], y[i : i + 1]), params, retain_graph=True)
        for i in range(len(ids))
    ]
    norms = [float(torch.sqrt(sum(g.square().sum() for g in gs))) for gs in per_example]
    c = sorted(norms)[len(norms) // 2]
    want = [
        sum(gs[k] * min(1.0, c / (n + 1e-12)) for gs, n in zip(per_example, norms, strict=True))
        for k in range(len(params))
    ]
    torch.manual_seed(11)
    _, got, got_norms = _clipped_sum(model, _cls_loss, batch, c)
    assert torch.allclose(got_norms, torch.tensor(norms, dtype=got_norms.dtype), rtol=1e-9)
    assert _relative(got, want) <= 1e-6
    torch.manual_seed(12)  # another draw of the masks gives other gradients: dropout was live
    _, other, _ = _clipped_sum(model, _cls_loss, batch, c)
    assert _relative(other, want) > 1e-3


def test_non_vanilla_layer_falls_back_to_per_module_rules() -> None:
    model = _classifier()
    layer = model.get_base_model().bert.encoder.layer[0].attention.self.query
    assert type(rule_for(layer)).__name__ == "LoraLinearRule"
    layer.base_layer.weight.requires_grad_(True)  # a trainable base weight: not vanilla LoRA
    assert type(rule_for(layer)).__name__ != "LoraLinearRule"
    model.eval()
    batch = _batch()
    _, want, _ = _naive_clipped_sum(model, _cls_loss, batch, 0.05)
    _, got, _ = _clipped_sum(model, _cls_loss, batch, 0.05)
    assert _relative(got, want) <= 1e-6


def _private_step(model, loss_fn, batch, c, sigma, lr, seed=0):
    ids, mask, y = batch
    data = TensorDataset(torch.stack([ids, mask], dim=1), y)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = PrivacyEngine(seed=seed, reproducible=True)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=len(data)),  # q = 1: every example in every step
        max_grad_norm=c,
        noise_multiplier=sigma,
    )
    for x, target in loader:
        optimizer.zero_grad()
        loss_fn(model, x[:, 0], x[:, 1], target).backward()
        optimizer.step()
        break
    return engine, model


def test_lora_update_after_a_step_matches_the_reference() -> None:
    """The Opacus #820 failure mode: adapters trained but their updates silently wrong (or none)."""
    model = _classifier()
    model.eval()
    batch = _batch()
    lr, c = 0.5, 0.05
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, clipped, _ = _naive_clipped_sum(model, _cls_loss, batch, c)
    names = {id(p): n for n, p in model.named_parameters()}
    _private_step(model, _cls_loss, batch, c, sigma=0.0, lr=lr)
    after = dict(model.named_parameters())
    want = [before[names[id(p)]] - lr * s / len(batch[0]) for p, s in zip(params, clipped, strict=True)]
    got = [after[names[id(p)]].detach() for p in params]
    deltas = [g - before[names[id(p)]] for g, p in zip(got, params, strict=True)]
    assert _relative(got, want) <= 1e-6
    assert _relative(deltas, [w - before[names[id(p)]] for w, p in zip(want, params, strict=True)]) <= 1e-6
    lora = [n for n in names.values() if "lora_" in n]
    assert lora and all(not torch.equal(after[n], before[n]) for n in lora if "lora_B" in n)
    frozen = [n for n, p in after.items() if not p.requires_grad]
    assert frozen and all(torch.equal(after[n], before[n]) for n in frozen)


def test_lora_update_carries_the_calibrated_noise() -> None:
    """Noise reaches every adapter: (reference − update)·B/lr is N(0, (σC)²) per coordinate.

    ~1,200 coordinates: the sample standard deviation's relative error is ≈ N(0, 1/(2n)) (sd 2%),
    so a 10% miss is 5 sd (probability < 1e-6); the mean check is also at 5 sd.
    """
    model = _classifier()
    model.eval()
    batch = _batch()
    lr, c, sigma = 0.5, 0.05, 2.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, clipped, _ = _naive_clipped_sum(model, _cls_loss, batch, c)
    names = {id(p): n for n, p in model.named_parameters()}
    _private_step(model, _cls_loss, batch, c, sigma=sigma, lr=lr, seed=5)
    after = dict(model.named_parameters())
    noise = torch.cat(
        [
            (
                (before[names[id(p)]] - lr * s / len(batch[0]) - after[names[id(p)]].detach())
                * len(batch[0])
                / lr
            ).flatten()
            for p, s in zip(params, clipped, strict=True)
        ]
    )
    assert noise.numel() > 1000
    assert abs(float(noise.std()) / (sigma * c) - 1) < 0.1
    assert abs(float(noise.mean())) < 5 * sigma * c / math.sqrt(noise.numel())


def test_model_keeps_generate_and_save_pretrained(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = apply_lora(
        transformers.GPT2LMHeadModel(config), LoraSettings(rank=2, targets=("c_attn",)), "CAUSAL_LM"
    )
    ids = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(ids, ids)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    private, optimizer, loader = PrivacyEngine(seed=0, reproducible=True).make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=4),
        max_grad_norm=1.0,
        noise_multiplier=1.0,
    )
    assert private is model
    for x, _ in loader:
        optimizer.zero_grad()
        logits = private(input_ids=x).logits[:, :-1]
        F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").sum(dim=1).mean().backward()
        optimizer.step()
    out = private.generate(input_ids=ids[:2, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)
    private.save_pretrained(tmp_path)
    torch.manual_seed(0)
    fresh = transformers.GPT2LMHeadModel(config)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    reloaded = dict(loaded.named_parameters())
    assert trained and all(torch.equal(p, reloaded[n]) for n, p in trained.items())


def test_bf16_autocast_on_cpu_matches_the_loop_at_bf16_precision() -> None:
    torch.manual_seed(0)
    model = _lora(transformers.BertForSequenceClassification(_config()), "SEQ_CLS")  # float32 weights
    model.eval()
    batch = _batch()

    def loss(m, ids, mask, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(input_ids=ids, attention_mask=mask).logits
        return F.cross_entropy(logits.float(), y)

    _, want, norms = _naive_clipped_sum(model, loss, batch, 1e9)
    c = sorted(norms)[len(norms) // 2]
    _, want, norms = _naive_clipped_sum(model, loss, batch, c)
    _, got, got_norms = _clipped_sum(model, loss, batch, c)
    assert got_norms.dtype == torch.float32 and all(t.dtype == torch.float32 for t in got)
    assert torch.allclose(got_norms, torch.tensor(norms), rtol=3e-2)
    assert _relative(got, want) <= 3e-2
