"""Loading a pretrained Hugging Face model and its tokenizer from a local folder, offline.

Nothing is downloaded: ``from_pretrained`` runs with ``local_files_only=True`` on a folder the user
names (pretrained weights are public: they are not private data and cost no privacy). Everything
that can be checked before the weights are read is checked first, so a wrong folder fails in a
second with one line instead of a stack trace, and a model too large for memory is refused from
its size on disk (the safetensors header, else the config) instead of being killed part-way.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from veil.errors import ConfigError

__all__ = [
    "FineTune",
    "ModelFolder",
    "available_memory",
    "check_fits",
    "inspect_folder",
    "load_tokenizer",
    "require_transformers",
]

FineTune = Literal["head", "lora", "full"]

_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
)
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# Bytes per parameter held while training in float32, by fine-tuning mode: the weights alone
# (head: the encoder runs once, without gradients), plus activations kept for the backward pass
# (lora), plus the gradient, the clipped sum and two Adam moments (full).
_BYTES_PER_PARAMETER = {"head": 4.0, "lora": 6.0, "full": 20.0}


def require_transformers() -> Any:
    """The ``transformers`` module, or a :class:`ConfigError` naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model",
            "hf:",
            "Hugging Face models need the transformers library, which is not installed",
            "pip install 'veil[hf]'",
        ) from None
    return transformers


@dataclass(frozen=True)
class ModelFolder:
    """A checked model folder: where it is, its config, and its parameter count (from the files)."""

    path: Path
    config: dict[str, Any]
    parameters: int
    counted_from: str  # "safetensors header" or "config"

    def training_bytes(self, mode: FineTune) -> int:
        """Memory the weights need while fine-tuning in ``mode`` (float32), activations excluded."""
        return int(self.parameters * _BYTES_PER_PARAMETER[mode])


def _fix_folder(path: str) -> str:
    return (
        f"point hf:{path} at a folder saved by save_pretrained (config.json, model.safetensors and the "
        "tokenizer files); nothing is downloaded"
    )


def inspect_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Check ``path`` holds a config, weights and a tokenizer, and count its parameters; loads nothing."""
    folder = Path(path)
    shown = str(path)
    if not folder.is_dir():
        raise ConfigError("model", f"hf:{shown}", "no such folder", _fix_folder(shown))
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError("model", f"hf:{shown}", "the folder has no config.json", _fix_folder(shown))
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "model", f"hf:{shown}", f"config.json does not parse ({exc})", _fix_folder(shown)
        ) from None
    if not any((folder / name).is_file() for name in _WEIGHTS):
        raise ConfigError(
            "model",
            f"hf:{shown}",
            f"the folder has no weights (none of {', '.join(_WEIGHTS)}); a model built from its config "
            "alone would start from random weights, not the pretrained ones",
            _fix_folder(shown),
        )
    if not any((folder / name).is_file() for name in _TOKENIZER):
        raise ConfigError(
            "model",
            f"hf:{shown}",
            f"the folder has no tokenizer (none of {', '.join(_TOKENIZER)}); text cannot be turned into "
            "the model's tokens",
            "save the tokenizer into the same folder (tokenizer.save_pretrained(folder))",
        )
    counted = _count_safetensors(folder)
    if counted is not None:
        return ModelFolder(folder, config, counted, "safetensors header")
    return ModelFolder(folder, config, _count_from_config(config), "config")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return []
        return [folder / s for s in sorted(shards)]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _count_safetensors(folder: Path) -> int | None:
    """Parameters listed in the safetensors headers (8-byte length, then JSON), or ``None``."""
    files = _safetensors_files(folder)
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with open(file, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                if length > 100_000_000:
                    return None
                header = json.loads(fh.read(length))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            total += math.prod(int(n) for n in entry.get("shape", []))
    return total


def _count_from_config(config: dict[str, Any]) -> int:
    """A transformer's parameter count from its config (embeddings + per-layer attention and MLP)."""
    hidden = int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 0)
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers") or 0)
    vocab = int(config.get("vocab_size") or 0)
    inner = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
    positions = int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    return (vocab + positions) * hidden + layers * (4 * hidden * hidden + 2 * hidden * inner)


def available_memory(device: str = "cpu") -> int:
    """Bytes that can still be allocated: free GPU memory for CUDA, else the OS's available memory."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size)


def check_fits(folder: ModelFolder, mode: FineTune, device: str = "cpu", limit: int | None = None) -> None:
    """Refuse, before loading, a model whose ``mode`` fine-tuning would not fit in memory.

    ``limit``: bytes allowed (default: what :func:`available_memory` reports now).
    """
    need = folder.training_bytes(mode)
    have = available_memory(device) if limit is None else int(limit)
    if need > have:
        raise ConfigError(
            "model",
            f"hf:{folder.path}",
            f"{folder.parameters / 1e6:,.1f} M parameters ({folder.counted_from}) need about "
            f"{need / 2**30:.1f} GiB to fine-tune with --fine-tune {mode}, and {have / 2**30:.1f} GiB is "
            "available on " + device + "; loading would be killed for lack of memory part-way",
            "use --fine-tune head or lora (far less memory than full), a smaller model, or a machine with "
            "more memory",
        )


def load_tokenizer(folder: ModelFolder) -> Any:
    """The tokenizer saved in the folder (offline)."""
    transformers = require_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder.path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for broken folders
        raise ConfigError(
            "model",
            f"hf:{folder.path}",
            f"the tokenizer does not load ({type(exc).__name__}: {str(exc)[:200]})",
            "save a working tokenizer into the folder with tokenizer.save_pretrained(folder)",
        ) from None
