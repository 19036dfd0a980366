"""A small zoo of DP-friendly models, and loading the user's own ``nn.Module``.

DP-SGD favours small models with bounded activations (tanh: Papernot et al. 2021, "Tempered sigmoid
activations for deep learning with differential privacy") and per-example normalisation (GroupNorm,
never BatchNorm, whose batch statistics mix examples). Names:

* ``auto`` — ``scatternet`` for images of at least 16×16 pixels, ``rff`` for smaller images such as
  the 8×8 digits, ``logreg`` for tables (chosen by data kind and shape only, never by looking at the
  private data, so the choice costs no privacy; on veil's benchmarks at ε = 3 the scattering network
  beats the end-to-end CNN on Fashion-MNIST, and random features beat logistic regression on pixels
  on digits);
* ``logreg`` — one linear layer;
* ``mlp`` — linear → tanh → linear;
* ``cnn`` — conv → GroupNorm → tanh blocks (two for small images, the Tramèr–Boneh 2021 layout for
  28×28) and a linear head;
* ``scatternet`` — a fixed wavelet scattering transform (:mod:`veil.models.scattering`; 8 angles;
  for images of at least 16 pixels a side the ``J = 2`` and ``J = 1`` transforms side by side, else
  ``J = 1``) followed by a trainable GroupNorm (per scale) and a linear layer (Tramèr & Boneh 2021,
  "ScatterNet + linear", with the finer scale added). Built as
  :class:`FixedFeaturesThenHead`, so training computes the fixed features once and DP-SGD trains
  only the head;
* ``rff`` — fixed random Fourier features (:mod:`veil.models.random_features`: 2,000 features of a
  Gaussian kernel with ``γ = 9.6 / d`` on the ``d`` inputs scaled to ``[0, 1]``, norm ≈ 3) and a
  linear layer: a kernel machine that DP-SGD trains as a linear head (also a
  :class:`FixedFeaturesThenHead`);
* ``package.module:factory`` — ``factory(input_shape, num_classes) -> nn.Module``.
"""

from __future__ import annotations

import importlib
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from veil.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "FEATURE_CHUNK_BYTES",
    "FRONT_WORK_PER_INPUT_BYTE",
    "MODELS",
    "RFF_FEATURES",
    "RFF_GAMMA_TIMES_INPUTS",
    "RFF_SCALE",
    "FixedFeaturesThenHead",
    "InputTransform",
    "build_model",
    "feature_chunk",
    "fixed_features",
    "resolve_name",
    "split_fixed_front",
]

MODELS = ("auto", "logreg", "mlp", "cnn", "scatternet", "rff")


class FixedFeaturesThenHead(nn.Sequential):
    """``head(features(x))`` where ``features`` is a fixed per-example map (no parameters).

    The contract that lets a trainer precompute ``features`` once, at no privacy cost: it has no
    trainable parameters, is deterministic, and maps each example on its own (no batch
    statistics, nothing learned from data). Neighbouring datasets then stay neighbouring after the
    map, so a DP guarantee for training ``head`` on the features holds for the raw inputs.
    """

    features: nn.Module
    head: nn.Module

    def __init__(self, features: nn.Module, head: nn.Module) -> None:
        if any(True for _ in features.parameters()):
            raise ValueError("the fixed feature map must have no parameters")
        super().__init__(OrderedDict(features=features, head=head))


def split_fixed_front(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """``(front, head)`` of ``Sequential(preprocess, net)`` when ``net`` is a
    :class:`FixedFeaturesThenHead` (``front`` = preprocessing then the fixed features, ``head`` shares
    the model's parameters), else ``(None, model)``: what DP-SGD needs to train, and on what."""
    if not (isinstance(model, nn.Sequential) and len(model) == 2):
        return None, model
    preprocess, net = model[0], model[1]
    if not isinstance(net, FixedFeaturesThenHead):
        return None, model
    return nn.Sequential(preprocess, net.features).eval(), net.head


FEATURE_CHUNK_BYTES = 256 * 2**20
"""The working memory :func:`fixed_features` plans per chunk (256 MiB), counting
:data:`FRONT_WORK_PER_INPUT_BYTE` bytes per input byte."""
FRONT_WORK_PER_INPUT_BYTE = 512
"""A fixed front's temporaries per float32 input byte, as planned: the J = 2 scattering transform
on 28×28 images takes 1.1–1.4 MB per 3.1 kB image (≈ 400×, measured), random features far less."""


def feature_chunk(example_shape: tuple[int, ...]) -> int:
    """Examples per chunk of :func:`fixed_features`: as many as :data:`FEATURE_CHUNK_BYTES` of planned
    work allows (:data:`FRONT_WORK_PER_INPUT_BYTE` per float32 input byte), between 1 and 1,024."""
    per_example = max(1, math.prod(int(v) for v in example_shape)) * 4 * FRONT_WORK_PER_INPUT_BYTE
    return max(1, min(1024, FEATURE_CHUNK_BYTES // per_example))


def fixed_features(
    front: nn.Module, x: np.ndarray, device: str = "cpu", chunk: int | None = None
) -> np.ndarray:
    """``front`` applied to every example of ``x`` (in chunks, no gradients) as a float32 array.

    Memory is the output plus one chunk's work: the chunks are written into one preallocated array
    (never a list joined at the end, which held every feature twice), and ``chunk`` (examples; by
    default :func:`feature_chunk`) bounds the front's own temporaries."""
    import numpy as np

    size = chunk if chunk is not None else feature_chunk(x.shape[1:])
    with torch.no_grad():
        if len(x) == 0:  # the features' shape, from a blank example (an FFT refuses empty input)
            blank = torch.zeros((1, *x.shape[1:]), dtype=torch.as_tensor(x).dtype, device=device)
            return front(blank)[:0].cpu().numpy().astype(np.float32)
        out: np.ndarray | None = None
        for i in range(0, len(x), size):
            part = front(torch.as_tensor(x[i : i + size], device=device)).cpu().numpy()
            if out is None:
                out = np.empty((len(x), *part.shape[1:]), dtype=np.float32)
            out[i : i + len(part)] = part
            del part
    assert out is not None
    return out


class InputTransform(nn.Module):
    """Fixed preprocessing as a layer: ``((asinh(clip(x)/r) − asinh(1/r)) − offset) · scale``.

    The log step runs only when ``resolution > 0``; ``lo``/``hi`` clip (±inf: no clipping). Holds
    buffers only (saved with the weights, so ``model.pt`` applies to raw inputs), nothing trainable.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    offset: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        lo: torch.Tensor,
        hi: torch.Tensor,
        offset: torch.Tensor,
        scale: torch.Tensor,
        resolution: float = 0.0,
    ) -> None:
        super().__init__()
        self.register_buffer("lo", lo)
        self.register_buffer("hi", hi)
        self.register_buffer("offset", offset)
        self.register_buffer("scale", scale)
        self.resolution = float(resolution)
        self._clip = bool(torch.isfinite(lo).any() or torch.isfinite(hi).any())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._clip:
            x = torch.clamp(x, self.lo, self.hi)
        if self.resolution > 0:
            r = self.resolution
            x = torch.asinh(x / r) - math.asinh(1.0 / r)
        return (x - self.offset) * self.scale

    def extra_repr(self) -> str:
        return f"resolution={self.resolution:g}, clip={self._clip}"


def _flat(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _groups(channels: int) -> int:
    for g in (8, 4, 2, 1):
        if channels % g == 0:
            return g
    return 1


def _image_shape(model: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(
            "model",
            model,
            f"this model needs images (C×H×W), and this data has shape {input_shape}",
            "use --model logreg or mlp for tables",
        )
    c, h, w = input_shape
    return c, h, w


def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat(input_shape), num_classes))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(_flat(input_shape), hidden), nn.Tanh(), nn.Linear(hidden, num_classes)
    )


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _image_shape("cnn", input_shape)
    if min(h, w) >= 20:
        # Tramèr & Boneh (2021) end-to-end CNN, with GroupNorm after each convolution.
        body = nn.Sequential(
            nn.Conv2d(c, 16, 8, stride=2, padding=3),
            nn.GroupNorm(_groups(16), 16),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.GroupNorm(_groups(32), 32),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Flatten(),
        )
        with torch.no_grad():
            features = body(torch.zeros(1, c, h, w)).shape[1]
        return nn.Sequential(body, nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, num_classes))
    body = nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1),
        nn.GroupNorm(_groups(16), 16),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.GroupNorm(_groups(32), 32),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
    )
    with torch.no_grad():
        features = body(torch.zeros(1, c, h, w)).shape[1]
    return nn.Sequential(body, nn.Linear(features, num_classes))


def scatternet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from veil.models.scattering import MultiScaleScattering, Scattering2d, ScatteringHead

    c, h, w = _image_shape("scatternet", input_shape)
    if min(h, w) >= 16:
        # J = 2 and J = 1 side by side, each group-normalised: on Fashion-MNIST at ε = 3 this beat
        # J = 2 alone on a validation split (docs/benchmarks.md, issue 29).
        front = MultiScaleScattering((c, h, w), (2, 1))
        return FixedFeaturesThenHead(front, ScatteringHead(front.parts, num_classes))
    features = Scattering2d((c, h, w), J=1)
    channels = features.channels
    # Per-example normalisation of groups of 3 scattering channels (Tramèr & Boneh 2021 use 27
    # groups for the 81 channels): the coefficients span orders of magnitude across orders.
    groups = channels // 3 if channels % 3 == 0 else _groups(channels)
    head = nn.Sequential(
        nn.GroupNorm(groups, channels),
        nn.Flatten(),
        nn.Linear(channels * math.prod(features.out_hw), num_classes),
    )
    return FixedFeaturesThenHead(features, head)


# Random-feature settings, chosen on digits at ε = 3 (bench/utility.py seeds 10–29, never the
# user's data): a kernel length scale proportional to √d keeps γ·‖x − y‖² comparable across input
# sizes; norm 3 matches the pixel vectors' typical norm, which the presets' clipping norm assumes.
RFF_FEATURES = 2000
RFF_GAMMA_TIMES_INPUTS = 9.6
RFF_SCALE = 3.0


def rff(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from veil.models.random_features import RandomFourierFeatures

    d = _flat(input_shape)
    features = RandomFourierFeatures(d, RFF_FEATURES, RFF_GAMMA_TIMES_INPUTS / d, scale=RFF_SCALE)
    return FixedFeaturesThenHead(features, nn.Linear(RFF_FEATURES, num_classes))


FIXED_FRONT_ZOO = ("rff", "scatternet")
"""The zoo models built as :class:`FixedFeaturesThenHead` (a data-independent front computed once)."""

_ZOO: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "logreg": logreg,
    "mlp": mlp,
    "cnn": cnn,
    "scatternet": scatternet,
    "rff": rff,
}


def resolve_name(name: str, kind: str, input_shape: tuple[int, ...] = ()) -> str:
    """The concrete zoo name (``auto`` → by data kind and size), or the factory path unchanged."""
    if name == "auto":
        if kind != "image" or len(input_shape) != 3:
            return "logreg"
        return "scatternet" if min(input_shape[1:]) >= 16 else "rff"
    return name


def _import_factory(path: str) -> Callable[..., nn.Module]:
    module_name, _, attr = path.partition(":")
    fix = "pass --model package.module:factory where factory(input_shape, num_classes) returns an nn.Module"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while importing the user's module
        raise ConfigError(
            "model",
            path,
            f"the module '{module_name}' does not import ({type(exc).__name__}: {exc})",
            fix + ", importable from here",
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError("model", path, f"'{module_name}' has no callable '{attr}'", fix)
    return factory


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, kind: str) -> nn.Module:
    """A fresh (randomly initialised from torch's current RNG state) model for the data."""
    concrete = resolve_name(name, kind, input_shape)
    if ":" in concrete:
        factory = _import_factory(concrete)
        try:
            model = factory(tuple(input_shape), int(num_classes))
        except Exception as exc:
            raise ConfigError(
                "model", concrete, f"the factory failed ({type(exc).__name__}: {exc})", "fix the factory"
            ) from None
        if not isinstance(model, nn.Module):
            raise ConfigError(
                "model",
                concrete,
                f"the factory returned {type(model).__name__}, not an nn.Module",
                "return an nn.Module",
            )
        return model
    if concrete not in _ZOO:
        import difflib

        close = difflib.get_close_matches(concrete, MODELS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            "model",
            concrete,
            "unknown model name",
            f"{hint}use one of {', '.join(MODELS)} or package.module:factory",
        )
    return _ZOO[concrete](tuple(input_shape), int(num_classes))
