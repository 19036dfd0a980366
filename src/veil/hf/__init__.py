"""DP fine-tuning of pretrained Hugging Face models on text (the optional extra ``veil[hf]``): the
public names of the text models (built in :mod:`veil.text`, below the jobs, where the pipeline
builds them for ``veil train --model hf:DIR``) and the job-level adapter:

* :mod:`veil.hf.trainer` — ``DPTrainer``, the ``transformers.Trainer`` with DP-SGD, and its
  ``PrivacyArguments`` (imported on first use: ``veil.hf.DPTrainer``);
* from :mod:`veil.text`: model folder checks (``inspect_folder``, ``check_fits``,
  ``load_tokenizer``), text checks and tokenizing (``check_texts``, ``tokenize``), the frozen
  encoder (``FrozenTextEncoder``) and the classifiers (``build_text_classifier``, ``LoraSettings``,
  ``apply_lora``, ``SequenceClassifier``, ``PooledClassifier``, ``declared_pooling``,
  ``autocast``).

Per-sample clipping of peft's LoRA layers lives with the other layer rules
(:mod:`veil.clipping.rules.lora`, registered the first time such a layer is seen). Importing this
package does not import transformers or peft; the functions that need them do.
"""

from __future__ import annotations

from typing import Any

from veil.text.features import FrozenTextEncoder
from veil.text.finetune import (
    FINE_TUNE_MODES,
    LoraSettings,
    PooledClassifier,
    SequenceClassifier,
    apply_lora,
    autocast,
    build_text_classifier,
    declared_pooling,
)
from veil.text.load import ModelFolder, check_fits, inspect_folder, load_tokenizer
from veil.text.tokens import DEFAULT_MAX_LENGTH, check_texts, tokenize

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "FINE_TUNE_MODES",
    "DPTrainer",
    "FrozenTextEncoder",
    "LoraSettings",
    "ModelFolder",
    "PooledClassifier",
    "PrivacyArguments",
    "SequenceClassifier",
    "apply_lora",
    "autocast",
    "build_text_classifier",
    "check_fits",
    "check_texts",
    "declared_pooling",
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
