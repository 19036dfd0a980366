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

    from veil.data import Dataset

__all__ = ["refuse_mixing_on_public_inputs", "synthetic_inputs"]

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
