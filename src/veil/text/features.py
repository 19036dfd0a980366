"""A frozen pretrained text encoder as a fixed feature map (``--fine-tune head``).

:class:`FrozenTextEncoder` maps one tokenized text (``[2, L]``: ids and attention mask) to the
mean of its last hidden states over the real tokens, scaled to unit L2 norm. It meets the contract
of :class:`veil.models.FixedFeaturesThenHead`: no trainable parameters, deterministic (the encoder
always runs in eval mode, without dropout, under ``no_grad``), and each example's features depend
on that example alone (attention is within one text; padding is masked out). A trainer can
therefore compute the features once for the whole dataset at no privacy cost and train only the
head with DP-SGD: neighbouring datasets stay neighbouring after the map.

The pretrained encoder is public (loaded from the user's folder); it is kept outside the module's
parameter tree, so it is neither trained, clipped nor saved with the head's weights (the folder
it came from is its record).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FrozenTextEncoder", "mean_pool", "synthetic_tokens", "trim_padding"]


def trim_padding(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop the trailing columns that are padding in every row of the batch.

    Exact: masked positions are never attended to, and trailing ones shift no position ids.
    """
    active = mask.any(dim=0).nonzero()
    keep = int(active.max()) + 1 if active.numel() else 1
    return ids[:, :keep], mask[:, :keep]


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``hidden`` ``[B, L, H]`` over the positions where ``mask`` ``[B, L]`` is 1."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


class FrozenTextEncoder(nn.Module):
    """``[B, 2, L]`` token ids and masks → ``[B, H]`` unit-norm mean-pooled features (no parameters)."""

    def __init__(self, encoder: nn.Module, source: str = "") -> None:
        super().__init__()
        encoder.eval()
        for p in encoder.parameters():
            p.requires_grad_(False)
        object.__setattr__(self, "_encoder", encoder)  # outside the parameter tree on purpose
        self.source = source
        config = getattr(encoder, "config", None)
        self.dim = int(getattr(config, "hidden_size", 0) or 0)

    @property
    def encoder(self) -> nn.Module:
        encoder: nn.Module = self.__dict__["_encoder"]
        return encoder

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        self.encoder._apply(fn)
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True) -> FrozenTextEncoder:
        super().train(mode)
        self.encoder.eval()  # the map stays deterministic whatever mode the whole model is in
        return self

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != 2:
            raise ValueError(f"expected tokenized text [B, 2, L] (ids, mask), got shape {tuple(x.shape)}")
        ids, mask = trim_padding(x[:, 0].long(), x[:, 1].long())
        with torch.no_grad():
            hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            pooled = mean_pool(hidden.to(torch.promote_types(hidden.dtype, torch.float32)), mask)
            return pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp_min(1e-12)

    def extra_repr(self) -> str:
        return f"source={self.source!r}, dim={self.dim}"


def synthetic_tokens(model: nn.Module, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Random token ids (uniform over the model's vocabulary, attention mask all ones) shaped
    ``shape = (n, 2, L)``: public probe inputs for checks that must not touch the private texts."""
    vocab = None
    for module in model.modules():
        inner = module.encoder if isinstance(module, FrozenTextEncoder) else module
        get = getattr(inner, "get_input_embeddings", None)
        if callable(get):
            embedding = get()
            vocab = int(getattr(embedding, "num_embeddings", 0)) or None
            break
    if vocab is None:
        raise ValueError("the model has no input embeddings to draw token ids for")
    n, _, length = shape
    ids = torch.randint(0, vocab, (n, length), generator=generator)
    return torch.stack([ids, torch.ones_like(ids)], dim=1)
