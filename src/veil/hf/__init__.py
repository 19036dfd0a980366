"""DP fine-tuning of pretrained Hugging Face models on text (the optional extra ``veil[hf]``).

* :mod:`veil.hf.load` — checking a local model folder (config, weights, tokenizer) and its memory
  needs before anything is loaded; offline only;
* :mod:`veil.hf.text` — text columns checked and tokenized to fixed-shape arrays;
* :mod:`veil.hf.features` — a frozen encoder as a fixed feature map (``head`` mode);
* :mod:`veil.hf.finetune` — classifiers in ``head`` / ``lora`` / ``full`` mode, bf16 autocast;
* :mod:`veil.hf.trainer` — ``DPTrainer``, the ``transformers.Trainer`` with DP-SGD, and its
  ``PrivacyArguments`` (imported on first use: ``veil.hf.DPTrainer``).

Per-sample clipping of peft's LoRA layers lives with the other layer rules
(:mod:`veil.clipping.rules.lora`, registered the first time such a layer is seen). Importing this
package does not import transformers or peft; the functions that need them do.
"""

from __future__ import annotations

from typing import Any

from veil.hf.features import FrozenTextEncoder
from veil.hf.finetune import (
    FINE_TUNE_MODES,
    LoraSettings,
    SequenceClassifier,
    apply_lora,
    autocast,
    build_text_classifier,
)
from veil.hf.load import ModelFolder, check_fits, inspect_folder, load_tokenizer
from veil.hf.text import DEFAULT_MAX_LENGTH, check_texts, tokenize

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "FINE_TUNE_MODES",
    "DPTrainer",
    "FrozenTextEncoder",
    "LoraSettings",
    "ModelFolder",
    "PrivacyArguments",
    "SequenceClassifier",
    "apply_lora",
    "autocast",
    "build_text_classifier",
    "check_fits",
    "check_texts",
    "inspect_folder",
    "load_tokenizer",
    "tokenize",
]


def __getattr__(name: str) -> Any:
    """``DPTrainer`` and ``PrivacyArguments`` load transformers' Trainer: imported when first used."""
    if name in ("DPTrainer", "PrivacyArguments"):
        from veil.hf import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'veil.hf' has no attribute {name!r}")
