"""Pretrained Hugging Face text models and text data, the building blocks below the jobs (optional
extra ``veil[hf]``): what the pipeline needs for ``veil train --model hf:DIR`` and what
:mod:`veil.hf` (the public names, and ``DPTrainer``) is made of.

* :mod:`veil.text.load` — checking a local model folder (config, weights, tokenizer) and its memory
  needs before anything is loaded; offline only;
* :mod:`veil.text.tokens` — text columns checked and tokenized to fixed-shape arrays;
* :mod:`veil.text.data` — a text classification dataset (CSV, Parquet, SQL) tokenized and split;
* :mod:`veil.text.features` — a frozen encoder as a fixed feature map (``head`` mode);
* :mod:`veil.text.finetune` — classifiers in ``head`` / ``lora`` / ``full`` mode, bf16 autocast.

Importing this package imports nothing (not torch, transformers or peft); each module imports what
it needs, transformers and peft only in the functions that use them. No module here imports a job
or a pipeline step.
"""
