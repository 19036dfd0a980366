"""Learned embeddings for wide categorical columns, in front of any tabular model.

The encoder writes an embedding-encoded column as one feature holding the level's code (``0..L-1``,
``L`` unknown, ``L+1`` missing). :class:`EmbedCodes` replaces each such feature by a trainable
``nn.Embedding`` vector and passes the other features through unchanged, so a model built for
``out_features`` inputs follows it. The embeddings are ordinary parameters: DP-SGD clips and noises
their per-example gradients like any other (veil's clipping has an exact rule for ``nn.Embedding``).
The layout (which positions hold codes, how many codes) comes from the schema, never from the data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["EmbedCodes", "embedding_dim"]


def embedding_dim(codes: int) -> int:
    """A common rule of thumb for the embedding width: ``min(16, round(1.6·codes^0.56))``, at least 2."""
    return max(2, min(16, round(1.6 * codes**0.56)))


class EmbedCodes(nn.Module):
    """Dense features pass through; each code column becomes its embedding (concatenated after them)."""

    def __init__(self, width: int, embeddings: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        code_positions = [p for p, _ in embeddings]
        dense = [j for j in range(width) if j not in set(code_positions)]
        self.dense_index: torch.Tensor
        self.register_buffer("dense_index", torch.tensor(dense, dtype=torch.long), persistent=False)
        self.code_positions = code_positions
        self.codes = [n for _, n in embeddings]
        self.embeddings = nn.ModuleList([nn.Embedding(n, embedding_dim(n)) for n in self.codes])
        self.out_features = len(dense) + sum(embedding_dim(n) for n in self.codes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x.index_select(1, self.dense_index)]
        for pos, n, emb in zip(self.code_positions, self.codes, self.embeddings, strict=True):
            # Codes are exact small integers stored as floats; clamp guards a corrupted input.
            idx = x[:, pos].round().long().clamp_(0, n - 1)
            parts.append(emb(idx))
        return torch.cat(parts, dim=1)

    def extra_repr(self) -> str:
        return f"codes at {self.code_positions} with {self.codes} levels (+unknown, missing)"


def with_embeddings(width: int, embeddings: Sequence[tuple[int, int]], head: nn.Module) -> nn.Module:
    """``EmbedCodes`` followed by ``head`` (built for ``EmbedCodes(...).out_features`` inputs)."""
    front = EmbedCodes(width, embeddings)
    return nn.Sequential(front, head)


def build_table_net(
    model: str, width: int, embeddings: Sequence[tuple[int, int]], num_classes: int
) -> nn.Module:
    """The zoo's (or the user's factory's) table model behind the embeddings of the code columns."""
    from veil.models import build_model

    head = build_model(model, (head_inputs(width, embeddings),), num_classes, "table")
    return with_embeddings(width, embeddings, head)


def head_inputs(width: int, embeddings: Sequence[tuple[int, int]]) -> int:
    """How many inputs the model after :class:`EmbedCodes` sees."""
    return width - len(embeddings) + sum(embedding_dim(n) for _, n in embeddings)
