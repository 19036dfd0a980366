"""Text classifiers from a pretrained Hugging Face model, in three fine-tuning modes.

* ``head``: the pretrained encoder is frozen and used as a fixed feature map
  (:class:`~veil.text.features.FrozenTextEncoder`, mean-pooled, unit norm); only a linear head is
  trained. The model is ``Sequential(Identity(), FixedFeaturesThenHead(encoder, head))``, the
  fixed-front layout, so a trainer computes the features once (:func:`veil.models.fixed_features`)
  and DP-SGD runs on the head alone: the cheapest mode by far, and the one that needs the least
  noise-free signal.
* ``lora``: peft's LoRA adapters (rank, alpha, target modules, dropout configurable) plus the
  classification head are trained; every pretrained weight stays frozen and costs nothing in
  clipping (see :mod:`veil.clipping.rules.lora`). The head reads the representation the folder
  declares: a sentence-transformers folder whose ``1_Pooling/config.json`` asks for mean pooling
  gets :class:`PooledClassifier` (mean-pooled, unit-norm states times a fixed √H into a linear head:
  at zero adapter update the ``head`` mode's model, so LoRA starts where the frozen head starts); any
  other folder gets the model's own classification head (:class:`SequenceClassifier`).
* ``full``: every parameter is trained (per-sample clipping over the whole model).

Models take one tensor ``[B, 2, L]`` (token ids and attention mask, from
:func:`veil.text.tokens.tokenize`) and return logits ``[B, K]``, like every other veil model, so the
engine's probes and samplers apply unchanged. The Hugging Face model stays reachable as
``.model`` with its own methods (``save_pretrained``, ``generate``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.errors import ConfigError
from veil.precision import autocast
from veil.text.batch_lookups import batch_of, expand_shared_lookups
from veil.text.features import FrozenTextEncoder, mean_pool, trim_padding
from veil.text.load import FineTune, ModelFolder, check_fits, require_transformers

__all__ = [
    "FINE_TUNE_MODES",
    "LoraSettings",
    "PooledClassifier",
    "SequenceClassifier",
    "apply_lora",
    "autocast",
    "build_text_classifier",
    "declared_pooling",
]

FINE_TUNE_MODES: tuple[FineTune, ...] = ("head", "lora", "full")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters: ``rank`` r, ``alpha`` (scaling ``alpha / r``), the names of the modules
    to adapt (``None``: peft's default for the architecture), and the adapter's input ``dropout``."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(
                "lora_rank", self.rank, "the adapter rank must be a positive int", "pass e.g. 8"
            )
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ConfigError(
                "lora_alpha", self.alpha, "the LoRA scaling alpha/r must be > 0", "pass e.g. 16"
            )
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigError("lora_dropout", self.dropout, "a dropout rate is in [0, 1)", "pass e.g. 0.1")
        if self.targets is not None and (
            not self.targets or not all(isinstance(t, str) and t for t in self.targets)
        ):
            raise ConfigError(
                "lora_targets",
                self.targets,
                "target modules are named by non-empty strings",
                "e.g. query,value",
            )


class SequenceClassifier(nn.Module):
    """``[B, 2, L]`` tokens → logits of a Hugging Face sequence-classification model (``.model``).

    Trailing columns that are padding in the whole batch are dropped before the forward (exact:
    they are masked out), which saves most of the work on short texts padded to a long
    ``max_length``. Embedding lookups the model shares across the batch (BERT's position ids,
    ``[1, T]``) get one row per example (:mod:`veil.text.batch_lookups`), so a full fine-tune trains
    and clips them like every other parameter.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        expand_shared_lookups(model)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != 2:
            raise ValueError(f"expected tokenized text [B, 2, L] (ids, mask), got shape {tuple(x.shape)}")
        ids, mask = trim_padding(x[:, 0].long(), x[:, 1].long())
        with batch_of(ids.shape[0], ids.shape[1]):
            logits: Tensor = self.model(input_ids=ids, attention_mask=mask).logits
        return logits


class PooledClassifier(nn.Module):
    """``[B, 2, L]`` tokens → logits: the encoder's (``.model``) last hidden states, mean-pooled over
    each text's real tokens and scaled to unit norm (as :class:`~veil.text.features.FrozenTextEncoder`),
    times ``√H`` (``H`` the hidden size), then a linear ``head``.

    The fixed factor ``√H`` gives the features unit scale per coordinate. It changes nothing the
    head can express (it is the frozen head's model with the weight scaled), but Adam moves every
    weight by about ``lr`` a step whatever its gradient's scale, so without it the head's logits
    would move ``√H`` times slower than with it: at the adapters' learning rate (2e-3) the head
    learnt too little in one epoch (a DP head-only proxy on 5,000 tweets: 0.686 at lr 2e-3 with the
    factor, 0.607 without).

    Each example's logits depend on that example alone (attention within one text, padding masked,
    the norm per row), so per-sample clipping applies unchanged; the head is a plain ``nn.Linear``.
    """

    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        get_base = getattr(encoder, "get_base_model", None)  # peft's wrapper: the model inside
        base: Any = get_base() if callable(get_base) else encoder
        if isinstance(getattr(base, "pooler", None), nn.Module):
            # BERT's [CLS] pooler is unused here: without it no adapter ("dense") sits where no
            # gradient reaches, and its forward is not paid for
            base.pooler = None
        self.model = encoder
        hidden = int(base.config.hidden_size)
        self.scale = float(hidden) ** 0.5
        self.head = nn.Linear(hidden, num_classes)
        expand_shared_lookups(encoder)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != 2:
            raise ValueError(f"expected tokenized text [B, 2, L] (ids, mask), got shape {tuple(x.shape)}")
        ids, mask = trim_padding(x[:, 0].long(), x[:, 1].long())
        with batch_of(ids.shape[0], ids.shape[1]):
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = mean_pool(hidden, mask)
        unit = pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp_min(1e-12)
        logits: Tensor = self.head(unit * self.scale)
        return logits


def declared_pooling(folder: ModelFolder) -> str | None:
    """The pooling a sentence-transformers folder declares (``"mean"``, ``"cls"``, ...), or ``None``.

    Read from ``1_Pooling/config.json`` (public: the model folder, not the data).
    """
    import json

    config = folder.path / "1_Pooling" / "config.json"
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    for mode in ("mean", "cls", "max"):
        if settings.get(f"pooling_mode_{mode}_tokens") is True:
            return mode
    return None


def apply_lora(model: nn.Module, settings: LoraSettings, task_type: str = "SEQ_CLS") -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters (pretrained weights frozen; the task's head trainable)."""
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "fine_tune",
            "lora",
            "LoRA needs the peft library, which is not installed",
            "pip install 'veil[hf]'",
        ) from None
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]
        target_modules=list(settings.targets) if settings.targets else None,
        lora_dropout=settings.dropout,
        task_type=task_type,
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            "lora_targets",
            settings.targets,
            f"peft could not place adapters ({str(exc)[:160]})",
            f"name linear modules of this model, e.g. among: {', '.join(names[:12])}",
        ) from None


def _quiet_transformers() -> Any:
    transformers = require_transformers()
    return transformers, transformers.logging.get_verbosity()


def _from_pretrained(loader: Any, folder: ModelFolder, **kwargs: Any) -> nn.Module:
    transformers, verbosity = _quiet_transformers()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # "newly initialised head" is expected here
    transformers.utils.logging.disable_progress_bar()
    try:
        model: nn.Module = loader.from_pretrained(
            str(folder.path), local_files_only=True, dtype=torch.float32, **kwargs
        )
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for broken folders
        raise ConfigError(
            "model",
            f"hf:{folder.path}",
            f"the model does not load ({type(exc).__name__}: {str(exc)[:200]})",
            "save the model with save_pretrained into the folder, with a config transformers knows",
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model


def build_text_classifier(
    folder: ModelFolder,
    num_classes: int,
    mode: FineTune = "lora",
    lora: LoraSettings | None = None,
    *,
    device: str = "cpu",
    memory_limit: int | None = None,
) -> nn.Module:
    """A ``[B, 2, L]`` → logits classifier from the pretrained model in ``folder`` (see module doc).

    The memory check runs first (from the file headers), then the weights are loaded. The new
    head's initial weights come from torch's current RNG state. ``lora`` on a folder that declares
    mean pooling (:func:`declared_pooling`) builds a :class:`PooledClassifier`, any other a
    :class:`SequenceClassifier`.
    """
    if mode not in FINE_TUNE_MODES:
        raise ConfigError("fine_tune", mode, "unknown fine-tuning mode", "use head, lora or full")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ConfigError(
            "num_classes", num_classes, "a classifier needs at least 2 classes", "check --target"
        )
    check_fits(folder, mode, device, memory_limit)
    transformers = require_transformers()
    if mode == "head":
        from veil.models import FixedFeaturesThenHead

        encoder = _from_pretrained(transformers.AutoModel, folder)
        front = FrozenTextEncoder(encoder, source=str(folder.path))
        return nn.Sequential(nn.Identity(), FixedFeaturesThenHead(front, nn.Linear(front.dim, num_classes)))
    if mode == "lora" and declared_pooling(folder) == "mean":
        return PooledClassifier(
            apply_lora(
                _from_pretrained(transformers.AutoModel, folder), lora or LoraSettings(), "FEATURE_EXTRACTION"
            ),
            num_classes,
        )
    model = _from_pretrained(transformers.AutoModelForSequenceClassification, folder, num_labels=num_classes)
    if mode == "lora":
        model = apply_lora(model, lora or LoraSettings())
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return SequenceClassifier(model)


def pipeline_net(cfg: Any, num_classes: int) -> nn.Module:
    """The network ``veil train`` trains for ``--model hf:DIR`` (``cfg``: a ``TrainConfig``).

    ``head``: the :class:`~veil.models.FixedFeaturesThenHead` itself (the pipeline puts its
    preprocessing layer in front and precomputes the features); ``lora``/``full``: a
    :class:`SequenceClassifier`.
    """
    from veil.text.data import model_folder
    from veil.text.load import inspect_folder

    if getattr(cfg, "init_from", None) is not None:
        raise ConfigError(
            "init_from",
            cfg.init_from,
            "an hf:DIR model starts from the pretrained weights in its folder",
            "drop --init-from (it is for the zoo's and your own models)",
        )
    folder = inspect_folder(model_folder(cfg.model))
    lora = None
    if cfg.fine_tune == "lora":
        targets = tuple(cfg.lora_targets) if cfg.lora_targets else None
        lora = LoraSettings(cfg.lora_rank, float(cfg.lora_alpha), targets, float(cfg.lora_dropout))
    model = build_text_classifier(folder, num_classes, cfg.fine_tune, lora, device=cfg.device)
    if cfg.fine_tune == "head":
        assert isinstance(model, nn.Sequential)
        return model[1]
    return model
