"""Synthetic inputs drawn from the data's public description, for checks that must not touch a
private row: the report's per-sample clipping check and the example-mixing probe.

The description is public by declaration: the input shape (a built-in dataset's documented shape, a
reviewed schema's encoded width, the tokenizer's ``max_length``), the kind of data, an image format's
documented pixel range, the model's vocabulary. No value of any record enters: a check run on these
inputs gives the same verdict for any two neighbouring datasets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.config import TrainConfig
    from veil.data import Dataset

__all__ = [
    "public_stand_in",
    "refuse_mixing_before_reading",
    "refuse_mixing_on_public_inputs",
    "synthetic_inputs",
]

PROBE_EXAMPLES = 4


def synthetic_inputs(model: nn.Module, data: Dataset, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` random inputs of ``data``'s public input shape, float64 (token ids for text):

    * text: token ids uniform over the model's vocabulary, attention mask all ones
      (:func:`veil.text.features.synthetic_tokens`);
    * images with a documented pixel range: uniform over ``[0, pixel_max]``;
    * anything else (encoded table rows, whose codes the model rounds and clamps): N(0, 3²)."""
    import torch

    shape = (n, *data.input_shape)
    if data.kind == "text":
        from veil.text.features import synthetic_tokens

        return synthetic_tokens(model, shape, generator)
    if data.kind == "image" and data.pixel_max:
        return torch.rand(shape, generator=generator, dtype=torch.float64) * data.pixel_max
    return torch.randn(shape, generator=generator, dtype=torch.float64) * 3.0


def refuse_mixing_on_public_inputs(model: nn.Module, data: Dataset, seed: int) -> None:
    """Refuse ``model`` (:class:`~veil.errors.ModelNotSupportedError`) if its forward mixes examples,
    probed on :data:`PROBE_EXAMPLES` synthetic inputs (:func:`synthetic_inputs`, seed derived for
    :attr:`Purpose.MIXING_PROBE`), never on the private rows: the verdict is a function of the model,
    the public input description and the seed alone."""
    import torch

    from veil.mixing_probe import refuse_example_mixing

    generator = torch.Generator().manual_seed(derive_seed(seed, Purpose.MIXING_PROBE))
    refuse_example_mixing(model, synthetic_inputs(model, data, PROBE_EXAMPLES, generator))


def public_stand_in(cfg: TrainConfig) -> Dataset | None:
    """A :class:`~veil.data.Dataset` with no row that carries what the reviewed schema declares (kind
    ``table``, the encoder and so the encoded width and embedding layout, the target's classes): the
    network built for it is the one built for the data. None where the description is not all in the
    settings (no schema, text, ``--init-from``)."""
    if cfg.table_schema is None or cfg.text_column is not None or cfg.model.startswith("hf:"):
        return None
    if cfg.init_from is not None:
        return None
    import numpy as np

    from veil.data import Dataset
    from veil.tables.encoder import TableEncoder
    from veil.tables.schema import load_schema

    schema = load_schema(cfg.table_schema)
    schema.require_reviewed(cfg.table_schema)
    encoder = TableEncoder(schema)
    empty = np.zeros((0, encoder.width), dtype=np.float32)
    labels = np.zeros(0, dtype=np.int64)
    return Dataset(
        name=cfg.dataset,
        kind="table",
        x_train=empty,
        y_train=labels,
        x_test=empty,
        y_test=labels,
        classes=list(schema.require_target("training").levels),
        sha256="",
        preset="table",
        encoder=encoder,
    )


def refuse_mixing_before_reading(cfg: TrainConfig) -> None:
    """The example-mixing probe before the budget is charged and before any row is read, on the
    network built for :func:`public_stand_in` (where the settings describe the data); the whole
    model is probed again, on public inputs too, once the data are loaded
    (:func:`veil.training.prepare.prepare_run`)."""
    from veil.pipeline.model import build_net

    data = public_stand_in(cfg)
    if data is not None:
        refuse_mixing_on_public_inputs(build_net(cfg, data, cfg.seed), data, cfg.seed)
