"""Model and optimizer building shared by every job that trains with DP-SGD.

The model is the zoo's (or the user's factory's) network, validated and fixed
(:mod:`veil.validation`), behind the run's public preprocessing layer. A model with a fixed front
(:class:`veil.models.FixedFeaturesThenHead`) is trained as its head on features the front computes
once per example (a fixed per-example map: no privacy cost); the released model maps raw inputs.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.config import TrainConfig
from veil.errors import ModelNotSupportedError
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    import torch
    from torch import nn

    from veil.data import Dataset
    from veil.data.preprocess import PreprocessingPlan
    from veil.data.whitening import WhiteningPlan
    from veil.engine import PrivacyEngine

__all__ = [
    "Trainable",
    "assemble",
    "build_net",
    "evaluate",
    "make_engine",
    "make_optimizer",
    "parameter_groups",
    "trainable",
]


def build_net(
    cfg: TrainConfig, data: Dataset, seed: int, *, whitening: WhiteningPlan | None = None
) -> nn.Module:
    """The configured network for ``data``, initialised from ``seed``, validated and fixed.

    ``whitening``: the scattering preset's whitened head (``Prepared.whitening``): the fixed front
    ends in :class:`~veil.models.scattering.UnitRows` and
    :class:`~veil.models.scattering.WhitenedRows` (its ``P`` set later) and the head is one linear
    layer (:func:`veil.models.scattering.unit_rows_net`)."""
    import torch

    from veil.models import build_model
    from veil.validation import fix, validate

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embeddings = data.encoder.embeddings if data.encoder is not None else []
        if cfg.model.startswith("hf:"):
            from veil.text.finetune import pipeline_net

            net = pipeline_net(cfg, data.num_classes)
        elif embeddings:  # wide categoricals: learned embeddings in front of the model (veil.tables)
            from veil.tables.model import build_table_net

            net = build_table_net(cfg.model, data.input_shape[0], embeddings, data.num_classes)
        else:
            net = build_model(cfg.model, data.input_shape, data.num_classes, data.kind)
            if whitening is not None:
                from veil.models.scattering import unit_rows_net

                net = unit_rows_net(net, row_norm=whitening.row_norm)
    if validate(net):
        net = fix(net)
        problems = validate(net)
        if problems:
            raise ModelNotSupportedError(problems)
    if cfg.init_from is not None and not cfg.model.startswith("hf:"):
        from veil.models.pretrained import pipeline_net as pretrained_net

        net = pretrained_net(cfg, data, net)
    elif not cfg.model.startswith("hf:"):
        from veil.models.pretrained import refuse_without_checkpoint

        refuse_without_checkpoint(cfg)
    return net


def assemble(prep: PreprocessingPlan, input_shape: tuple[int, ...], net: nn.Module) -> nn.Sequential:
    """The released model: the preprocessing layer (buffers only), then the network."""
    from torch import nn

    from veil.data.preprocess import build_transform

    return nn.Sequential(OrderedDict(preprocess=build_transform(prep, input_shape), net=net))


@dataclass
class Trainable:
    """What DP-SGD trains (``model``) and the released model (``full``, raw inputs in).

    ``front`` is the fixed feature map of a :class:`~veil.models.FixedFeaturesThenHead` (then
    ``model`` is its head, sharing parameters with ``full``), or None (then ``model`` is ``full``)."""

    full: nn.Module
    model: nn.Module
    front: nn.Module | None

    def inputs(self, x: np.ndarray, device: str) -> np.ndarray:
        """``x`` as ``model`` takes it: the fixed features, or ``x`` itself."""
        from veil.models import fixed_features

        return x if self.front is None else fixed_features(self.front, x, device)


def trainable(full: nn.Module) -> Trainable:
    """Split off a fixed front, if the model has one."""
    from veil.models import split_fixed_front

    front, head = split_fixed_front(full)
    return Trainable(full, head if front is not None else full, front)


def parameter_groups(cfg: TrainConfig, model: nn.Module) -> list[dict[str, Any]]:
    """``model``'s trained parameters as optimizer groups: with ``cfg.lora_lr`` set, LoRA's adapters
    (peft's ``lora_*`` weights) at that rate and every other trained weight (the head) at ``cfg.lr``;
    otherwise one group at ``cfg.lr``. Optimisation only: no privacy impact (the clipping and noise
    see the same parameters either way)."""
    assert cfg.lr is not None
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if cfg.lora_lr is None:
        return [{"params": [p for _, p in params], "lr": cfg.lr}]
    adapters = [p for name, p in params if "lora_" in name]
    others = [p for name, p in params if "lora_" not in name]
    groups = [{"params": adapters, "lr": cfg.lora_lr}, {"params": others, "lr": cfg.lr}]
    return [g for g in groups if g["params"]]


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer choice on ``model``'s trained parameters (:func:`parameter_groups`): Adam,
    or SGD with the configured momentum."""
    import torch

    assert cfg.lr is not None
    groups = parameter_groups(cfg, model)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum or 0.0)


def make_engine(cfg: TrainConfig, seed: int) -> PrivacyEngine:
    """A privacy engine with the configured accountant; noise and sampling from the OS CSPRNG (the
    default), or in research mode (``cfg.reproducible``) from the seed derived from ``seed`` for
    :attr:`Purpose.ENGINE`. No seed is derived in secure mode."""
    from veil.engine import PrivacyEngine

    if not cfg.reproducible:
        return PrivacyEngine(accountant=cfg.accountant)
    return PrivacyEngine(accountant=cfg.accountant, seed=derive_seed(seed, Purpose.ENGINE), reproducible=True)


def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, device: str, batch: int = 2048
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``x, y`` (a diagnostic: not private); both NaN
    (absent: ``null`` in a report) when there is no row, e.g. a keyed split that held none out."""
    import torch

    if len(x) == 0:
        return math.nan, math.nan

    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb = torch.as_tensor(x[i : i + batch], device=device)
            yb = torch.as_tensor(y[i : i + batch], device=device)
            out = model(xb)
            total_loss += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return total_loss / len(x), correct / len(x)
