"""Hyperparameter presets per kind of data, and filling a configuration's unset fields from them.

The presets were tuned on veil's benchmarks (public data, never the user's); which one applies is
decided from the configuration and the data's kind and shape only, so choosing it reads nothing
private. Only fields the user left unset are filled.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from veil.config import TrainConfig
    from veil.data import Dataset

__all__ = [
    "PRESETS",
    "WHITENING",
    "WHITENING_MIN_EPSILON",
    "apply_presets",
    "preset_for",
    "preset_of",
    "whitening_for",
]

# Tuned on veil's benchmarks (bench/utility.py; docs/train.md), per data kind; batch_size None
# below means "a share of N" (see apply_presets).
PRESETS: dict[str, dict[str, Any]] = {
    # Small images (8×8 digits at ε = 3) with logistic regression or another end-to-end model.
    "image-small": {
        "epochs": 8,
        "batch_size": 256,
        "max_grad_norm": 1.0,
        "optimizer": "sgd",
        "lr": {"sgd": 1.5, "adam": 0.1},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # Small images with the random-feature model (`rff`, the `auto` choice): digits at ε = 3.
    "image-rff": {
        "epochs": 10,
        "batch_size": 256,
        "max_grad_norm": 1.0,
        "optimizer": "sgd",
        "lr": {"sgd": 0.8, "adam": 0.05},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # 28×28 images (Fashion-MNIST, MNIST): the Tramèr & Boneh (2021) end-to-end CNN settings.
    "image": {
        "epochs": 40,
        "batch_size": 2048,
        "max_grad_norm": 0.1,
        "optimizer": "sgd",
        "lr": {"sgd": 4.0, "adam": 1e-3},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # 28×28 images with the scattering front end (Tramèr & Boneh 2021, ScatterNet + linear):
    # large batches, C = 0.1; only the GroupNorm + linear head is trained. physical_batch_size is
    # memory only (never ε): logical batches of 8192 computed in chunks of 1024 kept the run's
    # resident memory lower where whole batches grew it by ~125 MB a step, to 7.8 GB (docs/benchmarks.md).
    # Batch 16384 with lr 16 over 60 epochs (240 steps, σ 5.99) beat batch 8192, lr 8, 40 epochs (320
    # steps, σ 3.54) on seeds 0 and 1: 0.8902/0.8897 against 0.8872/0.8873 (bench/fashion_scatter_levers.py).
    # The same schedule serves the two-scale head (J = 2 and J = 1 side by side, issue 29): on a
    # validation split it beat the J = 2 head on seeds 0 and 1 (0.8988/0.8998 against 0.8932/0.8987).
    "image-scatternet": {
        "epochs": 60,
        "batch_size": 16384,
        "physical_batch_size": 1024,
        "max_grad_norm": 0.1,
        "optimizer": "sgd",
        "lr": {"sgd": 16.0, "adam": 1e-3},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # Text through a frozen pretrained encoder (--fine-tune head): a linear head on unit-norm
    # features; MiniLM on the tweets (bench/finetune.py).
    "text": {
        "epochs": 20,
        "batch_size": 1024,
        "max_grad_norm": 1.0,
        "optimizer": "sgd",
        "lr": {"sgd": 2.0, "adam": 0.05},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # Text, LoRA or full fine-tuning of a pretrained model (bench/finetune.py's recipe).
    "text-finetune": {
        "epochs": 2,
        "batch_size": 64,
        "max_grad_norm": 1.0,
        "optimizer": "adam",
        "lr": {"sgd": 0.05, "adam": 2e-3},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
    # Tables (breast-cancer at ε = 1): two Poisson batches per epoch (batch_size None: ⌈N/2⌉), Adam.
    "table": {
        "epochs": 50,
        "batch_size": None,
        "max_grad_norm": 1.0,
        "optimizer": "adam",
        "lr": {"sgd": 1.0, "adam": 0.05},
        "momentum": 0.9,
        "ema_decay": 0.0,
    },
}


# The scattering preset's DP whitening (veil.data.whitening): DP-SGD on the head's unit rows whitened by
# one Gaussian release of their Gram matrix (noise std 6 per coordinate, composed before the steps),
# ridge 0.02 (a little above the noise's edge 2S√d/n ≈ 0.017 on Fashion-MNIST), each whitened row
# scaled to norm 60 (the GroupNorm rows' scale, at which lr 16 and C = 0.1 were tuned). On
# Fashion-MNIST at ε = 3: +0.74 validation, +0.73 test over the preset without it, 3 seeds
# (bench/fashion_scatter_levers.py --whiten 6 --whiten-ridge 0.02; docs/benchmarks.md).
WHITENING: dict[str, dict[str, float]] = {
    "image-scatternet": {"std": 6.0, "ridge": 0.02, "row_norm": 60.0},
}


WHITENING_MIN_EPSILON = 2.0
"""The smallest target ε the scattering preset whitens at. The Gram release costs ε ≈ 0.59 on its own
(S = 6, δ = 1e-5), which small targets cannot spare: on Fashion-MNIST (seed 0, secure noise) the
whitened head gave 0.8713 at ε = 1 against the unwhitened two-scale head's 0.8782, and 0.8983 at
ε = 2 against 0.8927 (docs/benchmarks.md, "accuracy by ε, the whitened default"); at ε = 0.5 the
release alone would pass the target. Between 1 and 2 nothing was measured; 2 is the first ε seen
ahead."""


def whitening_for(
    preset: str, model: str, input_shape: tuple[int, ...], epsilon: float | None = None
) -> dict[str, float] | None:
    """The preset's whitening settings, or None: only the scattering preset's two-scale head (images of
    at least 16 × 16 pixels, :func:`veil.models.scatternet`) has one, and only at a target ε of at
    least :data:`WHITENING_MIN_EPSILON` (``None``: no target, e.g. a given noise multiplier).
    Decided from public facts only (the settings and the data's kind and shape)."""
    settings = WHITENING.get(preset)
    if settings is None or model != "scatternet" or len(input_shape) != 3 or min(input_shape[1:]) < 16:
        return None
    if epsilon is not None and epsilon < WHITENING_MIN_EPSILON:
        return None
    return dict(settings)


def preset_for(model: str, data: Dataset) -> str:
    """The preset of the data's kind, refined by the model (``auto`` resolved) where that changes
    the optimum; decided from the configuration and the data's kind and shape only."""
    return preset_of(model, data.preset, data.kind, data.input_shape)


def preset_of(model: str, preset: str, kind: str, input_shape: tuple[int, ...]) -> str:
    """:func:`preset_for` from the data's preset, kind and example shape alone (a built-in dataset's
    are public before a row is read: :data:`veil.data.BUILTIN_SHAPES`, :data:`veil.data.BUILTIN_PRESETS`)."""
    from veil.models import resolve_name

    name = resolve_name(model, kind, input_shape)
    if preset == "image" and name == "scatternet":
        return "image-scatternet"
    if preset == "image-small" and name == "rff":
        return "image-rff"
    return preset


def apply_presets(config: TrainConfig, preset: str, n_train: int) -> TrainConfig:
    """Fill every unset hyperparameter from :data:`PRESETS` (chosen without the user's data).

    A preset's ``physical_batch_size`` is a memory setting (chunks of a logical batch): it changes
    neither the sampled batches nor ε."""
    values = dict(PRESETS[preset])
    if values["batch_size"] is None:
        values["batch_size"] = max(1, math.ceil(n_train / 2))  # two steps per epoch
    values["batch_size"] = min(int(values["batch_size"]), n_train)
    if values.get("physical_batch_size") is not None:
        values["physical_batch_size"] = min(int(values["physical_batch_size"]), values["batch_size"])
    values["optimizer"] = config.optimizer or values["optimizer"]
    values["lr"] = values["lr"][values["optimizer"]]
    update = {k: v for k, v in values.items() if getattr(config, k) is None}
    return config.model_copy(update=update)
