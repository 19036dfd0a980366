"""Embedding lookups shared by a whole batch, given one row per example so that they can be clipped.

Many Hugging Face models look their position embeddings up once for the batch: BERT (and MiniLM)
index ``position_embeddings`` with ``position_ids`` of shape ``[1, T]`` and let the addition to the
``[B, T, D]`` token embeddings broadcast the result. The per-sample clipper needs every layer to see
the examples in dimension 0, so it refuses such a lookup (a batch of 1 against B elsewhere), and a
full fine-tune could only train these embeddings by freezing them.

:func:`expand_shared_lookups` hooks every ``nn.Embedding`` of a model: inside a forward run under
:func:`batch_of` ``(B, T)`` (which :class:`~veil.hf.finetune.SequenceClassifier` and
:class:`~veil.hf.trainer.DPTrainer` do for ``B`` texts of ``T`` tokens), an index of shape
``[1, T]`` (a batch dimension of 1, one entry per token) is expanded to ``[B, T]`` (a view, no copy)
before the lookup; other shapes are left alone (ids already one row per example, a ``[T, T]``
relative-position table). Exact: the expanded lookup returns the same rows for every example,
``emb(idx.expand(B, T)) = emb(idx).expand(B, T, D)``, which is what the broadcast addition produced;
the summed gradient is unchanged, and example ``i``'s own gradient of the table is now visible to the
clipper (the output gradients of its own row). The hook is a module-level function reading a context
variable, so copies and pickles of the model carry no reference to any batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from torch import Tensor, nn

__all__ = ["batch_of", "expand_shared_lookups"]

_BATCH: ContextVar[tuple[int, int] | None] = ContextVar("veil_hf_batch", default=None)


@contextlib.contextmanager
def batch_of(size: int, tokens: int) -> Iterator[None]:
    """Within this block, a ``[1, tokens]`` lookup of a hooked embedding is expanded to ``size`` rows."""
    token = _BATCH.set((int(size), int(tokens)))
    try:
        yield
    finally:
        _BATCH.reset(token)


def _expanded(index: Any, batch: tuple[int, int]) -> Any:
    size, tokens = batch
    if isinstance(index, Tensor) and tuple(index.shape) == (1, tokens) and size > 1:
        return index.expand(size, tokens)
    return index


def _expand_lookup(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    batch = _BATCH.get()
    if batch is None:
        return None
    if args:
        return (_expanded(args[0], batch), *args[1:]), kwargs
    if "input" in kwargs:
        return args, {**kwargs, "input": _expanded(kwargs["input"], batch)}
    return None


def expand_shared_lookups(model: nn.Module) -> None:
    """Hook every ``nn.Embedding`` in ``model`` to expand a batch-1 index under :func:`batch_of`."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and _expand_lookup not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_expand_lookup, with_kwargs=True)  # once per module
