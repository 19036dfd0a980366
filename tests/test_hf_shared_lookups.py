"""Full fine-tuning of a BERT classifier: position embeddings (looked up once for the batch) clipped exactly.

BERT indexes ``position_embeddings`` with ``position_ids`` of shape ``[1, T]``; veil's
:class:`~veil.hf.SequenceClassifier` expands such lookups to the batch (:mod:`veil.text.batch_lookups`),
so every parameter, these embeddings included, gets its per-example gradient clipped. The reference
is independent of the clipper: one example at a time through the same wrapper, float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from veil.clipping import PerSampleClipper  # noqa: E402
from veil.errors import ModelNotSupportedError  # noqa: E402
from veil.hf import SequenceClassifier  # noqa: E402
from veil.text.batch_lookups import batch_of  # noqa: E402

VOCAB, LABELS = 40, 3


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        type_vocab_size=2,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config).double()
    with torch.no_grad():  # position rows differ a lot, so a wrong row assignment shows in the norms
        model.bert.embeddings.position_embeddings.weight.normal_(0.0, 1.0)
    model.eval()
    return model


def _batch(n: int = 6, length: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # examples of different lengths: their position rows differ
    mask[2, 7:] = 0
    mask[3, 2:] = 0
    return torch.stack([ids * mask, mask], dim=1), torch.randint(0, LABELS, (n,), generator=g)


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


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True)))
    return num / math.sqrt(sum(float(b.square().sum()) for b in want))


def test_full_fine_tune_clips_position_embeddings_exactly() -> None:
    model = SequenceClassifier(_bert())
    x, y = _batch()
    _, _, norms = _naive(model, x, y, 1e9)
    c = sorted(norms)[len(norms) // 2]  # half the examples are clipped
    params, want, naive_norms = _naive(model, x, y, c)
    clipper = PerSampleClipper(model, c)
    try:
        positions = model.model.bert.embeddings.position_embeddings.weight
        assert any(p is positions for p in clipper.parameters)  # trained, not frozen
        F.cross_entropy(model(x), y).backward()
        got_norms = clipper.accumulate()
        got = clipper.clipped_sum()
        assert [id(p) for p in clipper.parameters] == [id(p) for p in params]
    finally:
        clipper.remove()
    assert torch.allclose(got_norms, torch.tensor(naive_norms, dtype=got_norms.dtype), rtol=1e-9)
    assert _relative(got, want) <= 1e-9
    index = [id(p) for p in params].index(id(positions))
    assert _relative([got[index]], [want[index]]) <= 1e-9


def test_expanded_lookup_changes_no_output_and_no_summed_gradient() -> None:
    bert = _bert()
    model = SequenceClassifier(bert)
    x, y = _batch()
    out = model(x)
    F.cross_entropy(out, y).backward()
    wrapped = [p.grad.clone() for p in bert.parameters()]
    bert.zero_grad()
    ids, mask = x[:, 0], x[:, 1]
    ref = bert(input_ids=ids, attention_mask=mask).logits  # outside batch_of: the hooks leave it alone
    F.cross_entropy(ref, y).backward()
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(wrapped, (p.grad for p in bert.parameters()), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_shared_lookup_is_refused_without_the_expansion() -> None:
    # The hook is what makes the lookup clippable: the bare model's batch-1 lookup is refused.
    bert = _bert()
    x, y = _batch()
    clipper = PerSampleClipper(bert, 1.0)
    try:
        F.cross_entropy(bert(input_ids=x[:, 0], attention_mask=x[:, 1]).logits, y).backward()
        with pytest.raises(ModelNotSupportedError, match="different numbers of examples"):
            clipper.accumulate()
    finally:
        clipper.remove()


def test_batch_of_expands_only_a_lookup_of_one_row_of_the_batch_tokens() -> None:
    emb = torch.nn.Embedding(10, 3)
    from veil.text.batch_lookups import expand_shared_lookups

    expand_shared_lookups(emb)
    shared = torch.arange(4).unsqueeze(0)
    with batch_of(5, 4):
        assert emb(shared).shape == (5, 4, 3)
        assert emb(input=shared).shape == (5, 4, 3)
        assert emb(torch.arange(8).reshape(2, 4)).shape == (2, 4, 3)  # one row per example already
        assert emb(torch.arange(4)).shape == (4, 3)  # one dimension: no batch to expand
        assert emb(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 3)  # not one entry per token
        assert emb(torch.zeros(1, 4, 4, dtype=torch.long)).shape == (1, 4, 4, 3)  # a table, not ids
    with batch_of(1, 4):  # a batch of one text: nothing to expand
        assert emb(shared).shape == (1, 4, 3)
    assert emb(shared).shape == (1, 4, 3)  # outside a batch: untouched
