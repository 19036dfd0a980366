"""Embedding front for wide categoricals: layout from the schema, exact per-example clipping under DP-SGD."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("pyarrow")

from veil.clipping import PerSampleClipper
from veil.tables.encoder import TableEncoder
from veil.tables.model import EmbedCodes, head_inputs, with_embeddings
from veil.tables.schema import ColumnSpec, TableSchema


def _encoder() -> TableEncoder:
    schema = TableSchema(
        (
            ColumnSpec("age", "numeric", bounds=(0.0, 100.0)),
            ColumnSpec("zip", "categorical", levels=tuple(f"z{i}" for i in range(40)), encoding="embedding"),
            ColumnSpec("sex", "categorical", levels=("f", "m")),
            ColumnSpec("y", "categorical", "target", levels=("0", "1"), unknown="error"),
        ),
        reviewed=True,
    )
    return TableEncoder(schema)


def test_codes_become_embeddings_and_dense_features_pass_through() -> None:
    enc = _encoder()
    assert enc.embeddings == [(2, 42)]  # age, age:missing, then zip's code; 40 levels + unknown + missing
    front = EmbedCodes(enc.width, enc.embeddings)
    x = torch.zeros(3, enc.width)
    x[:, 0] = torch.tensor([0.5, -0.5, 0.0])
    x[:, 2] = torch.tensor([0.0, 40.0, 41.0])
    out = front(x)
    assert out.shape == (3, head_inputs(enc.width, enc.embeddings)) == (3, front.out_features)
    dense = [j for j in range(enc.width) if j != 2]
    torch.testing.assert_close(out[:, : len(dense)], x[:, dense])
    torch.testing.assert_close(out[1, len(dense) :], front.embeddings[0].weight[40])


def test_per_example_clipping_is_exact_through_the_embeddings() -> None:
    """The clipped sum equals a naive per-example loop (float64; tolerance 1e-9)."""
    torch.manual_seed(0)
    enc = _encoder()
    model = with_embeddings(enc.width, enc.embeddings, nn.Linear(head_inputs(enc.width, enc.embeddings), 2))
    model = model.double()
    g = np.random.default_rng(0)
    x = torch.zeros(8, enc.width, dtype=torch.float64)
    x[:, 0] = torch.from_numpy(g.uniform(-1, 1, 8))
    x[:, 2] = torch.from_numpy(g.integers(0, 42, 8).astype(np.float64))
    x[:, 3 + g.integers(0, 2, 8)] = 1.0
    y = torch.from_numpy(g.integers(0, 2, 8))
    bound = 0.05
    want = [torch.zeros_like(p) for p in model.parameters()]
    ref = copy.deepcopy(model)
    for i in range(8):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        norm = float(torch.sqrt(sum((gr**2).sum() for gr in grads)))
        for w, gr in zip(want, grads, strict=True):
            w += gr * min(1.0, bound / (norm + 1e-12))
    clipper = PerSampleClipper(model, bound, loss_reduction="mean")
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        clipper.accumulate()
        got = clipper.clipped_sum()
    finally:
        clipper.remove()
    for gt, w in zip(got, want, strict=True):
        torch.testing.assert_close(gt, w, rtol=1e-9, atol=1e-12)
