"""Starting a vision (or table) model from public pretrained weights: ``--init-from CHECKPOINT``.

``CHECKPOINT`` is a weights file — a veil run's ``model.pt``, the run folder that holds it, or any
torch ``state_dict`` saved with ``torch.save`` — read with ``torch.load(weights_only=True)``: a pickled
module (which runs code when loaded) is refused, its ``state_dict`` is what to save. The weights are
copied into the configured network (same architecture; strict key and shape match), then
``fine_tune`` chooses what DP-SGD trains:

* ``head`` — the classifier only (the last parameterised layer);
* ``last-k`` — the last ``k`` parameterised layers (a layer: a module with parameters of its own,
  in registration order; a GroupNorm counts as one);
* ``full`` — every parameter, from the pretrained values.

When the frozen layers form a prefix of a plain ``nn.Sequential`` (every zoo model), they become a
:class:`~veil.models.FixedFeaturesThenHead` front: their weights are turned into buffers (saved in
``model.pt``, never trained), the map runs in eval mode, and the trainer computes its features once
(the fixed-front path). Otherwise the frozen layers get ``requires_grad=False`` and the forward runs
through them each step (the clipper ignores frozen parameters).

Privacy. Pretrained weights are used as they are, at no privacy cost, **only if they are public**:
trained without this run's private rows. The user declares this by passing ``--init-from`` (as the
label set is declared by ``--classes``); the report's ``pretrained`` section records the declaration,
the file's SHA-256 and what was trained. What veil can check, it checks, and refuses a checkpoint
trained on this same dataset — its weights are a DP release of these rows, and starting from them
would spend budget this run's ledger does not hold:

* before a row is read (:func:`refuse_released_here`), whatever the file's path or name: a file whose
  SHA-256 the budget registry records as published by a run on this run's dataset (its registry
  identity, the name its file is recorded for, or the file's content fingerprint;
  :mod:`veil.registry.released`), and one whose ``report.json`` beside it (a copied ``release/``
  folder) names this dataset (``dataset_budget.dataset_id``: the name, or the id the release names a
  content-fingerprinted file by);
* once the data is identified (:func:`refuse_same_dataset`): a veil run folder whose ledger headers
  or report name the same data fingerprint, registry identity or dataset name.

veil does not compose two runs' spends: continue a run with ``--resume`` instead. A copy made outside
veil's knowledge (another registry, the bytes changed) is the user's declaration that it is public.

A classifier whose shape differs from the checkpoint's (another class count) is re-initialised from
the run's seed, and the report says so; any other mismatch is refused.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from veil.accounting.ledger import file_sha256
from veil.errors import ConfigError

if TYPE_CHECKING:
    from veil.registry.charge import DatasetCharge

__all__ = [
    "FINE_TUNE_VISION",
    "Checkpoint",
    "FrozenLayers",
    "parameterised_layers",
    "read_checkpoint",
    "refuse_released_here",
    "refuse_same_dataset",
    "start_from",
]

FINE_TUNE_VISION = ("head", "last-k", "full")


@dataclass(frozen=True)
class Checkpoint:
    """A weights file as read: its tensors (the network's keys), SHA-256, and, for a veil run, the
    data that run trained on (from its ledger headers and report)."""

    path: Path
    state: dict[str, torch.Tensor]
    sha256: str
    run_dataset_sha256s: frozenset[str] = frozenset()
    run_dataset_ids: frozenset[str] = frozenset()
    run_dataset_name: str | None = None

    @property
    def from_veil_run(self) -> bool:
        return bool(self.run_dataset_sha256s or self.run_dataset_ids or self.run_dataset_name)


@dataclass
class StartedFrom:
    """What :func:`start_from` did: for the report's ``pretrained`` section."""

    trained: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    reinitialised: list[str] = field(default_factory=list)
    fixed_front: bool = False


def _fix(path: str) -> str:
    return (
        f"pass --init-from with a weights file saved by torch.save(model.state_dict(), {path!r}), a veil "
        "run's model.pt or its run folder"
    )


def _run_headers(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger headers (first lines) of a veil run folder: its own ledger and, for ``veil tune``,
    each trial's."""
    headers = []
    for ledger in [run_dir / "ledger.jsonl", *sorted(run_dir.glob("trials/*/ledger.jsonl"))]:
        try:
            with ledger.open("rb") as fh:
                first = json.loads(fh.readline())
        except (OSError, ValueError):
            continue
        if isinstance(first, dict):
            headers.append(first)
    return headers


def _run_dataset_name(run_dir: Path) -> str | None:
    """The dataset a veil report names (``train``: ``dataset.name``; other jobs: ``dataset``)."""
    try:
        dataset = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    name = dataset.get("name") if isinstance(dataset, dict) else dataset
    return str(name) if isinstance(name, str) and name else None


def read_checkpoint(spec: str) -> Checkpoint:
    """Read ``spec`` (a weights file or a veil run folder) as tensors; loads no code."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise ConfigError("init_from", spec, "there is no such weights file", _fix(spec))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refuses anything but tensors and plain containers
        raise ConfigError(
            "init_from",
            spec,
            "it holds Python objects besides tensors (a pickled module?), and loading them would run code",
            _fix(spec),
        ) from None
    except Exception as exc:  # not a torch file at all
        first = (str(exc).splitlines() or [""])[0][:160]
        raise ConfigError(
            "init_from", spec, f"not a torch weights file ({type(exc).__name__}: {first})", _fix(spec)
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not (
        isinstance(state, dict)
        and state
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise ConfigError("init_from", spec, "the file holds no state_dict (names → tensors)", _fix(spec))
    headers = _run_headers(path.parent)
    if headers or any(k.startswith("preprocess.") for k in state):
        # A veil model.pt: Sequential(preprocess=..., net=...). The preprocessing is this run's own.
        state = {k[4:]: v for k, v in state.items() if k.startswith("net.")}
    return Checkpoint(
        path=path,
        state=state,
        sha256=file_sha256(path),
        run_dataset_sha256s=frozenset(str(h["dataset_sha256"]) for h in headers if h.get("dataset_sha256")),
        run_dataset_ids=frozenset(str(h["budget_dataset_id"]) for h in headers if h.get("budget_dataset_id")),
        run_dataset_name=_run_dataset_name(path.parent),
    )


def _weights_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    return path / "model.pt" if path.is_dir() else path


def _same_dataset(path: Path, what: str | None) -> ConfigError:
    return ConfigError(
        "init_from",
        str(path),
        "it comes from a veil run on this same dataset"
        + (f" ({what})" if what else "")
        + ": its weights are a DP release of these private rows, not public weights, and starting "
        "from them would spend budget this run's ledger does not hold",
        "start from weights trained on other (public) data, or continue that run with --resume",
    )


def _report_dataset_id(folder: Path) -> str | None:
    """``dataset_budget.dataset_id`` of the veil report in ``folder`` (a ``release/`` folder: the id
    the release names its dataset by), or None."""
    try:
        budget = json.loads((folder / "report.json").read_text(encoding="utf-8"))["dataset_budget"]
        found = budget["dataset_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if isinstance(found, str) and found else None


def refuse_released_here(spec: str, charge: DatasetCharge) -> None:
    """Refuse ``--init-from spec`` before a private row is read when its weights are a release of
    this run's dataset, whatever the file's path (see the module doc). ``charge``: the run's account,
    its dataset identified (nothing reserved yet). Reads the registry and the checkpoint's folder
    only; a file that cannot be read is left to :func:`read_checkpoint`'s own refusal.

    Guarantee: a model file a run published under ``release/`` (recorded by
    :func:`veil.report.publish.publish`) is refused as a starting point of any later run charged to
    the same dataset in the same registry — under the same name, the file recorded for that name, or
    the same file content — so a released model's stated ε never leaves out a run on its rows. A
    file with a veil report or a run ledger beside it that names this dataset is refused here too,
    whichever registry its run was charged in: these facts are on disk before any row is read, so
    the refusal never comes after the charge."""
    from veil.registry.public_ids import known_released_id
    from veil.registry.released import datasets_releasing

    path = _weights_path(spec)
    try:
        sha256 = file_sha256(path)
    except OSError:
        return
    db = charge.registry.db
    ours = {charge.identity.id}
    if charge.fingerprint is not None:
        ours.add(charge.fingerprint)
        name = charge.registry.name_of(charge.fingerprint)
        if name is not None:
            ours.add(name)
    if datasets_releasing(db, sha256) & ours:
        raise _same_dataset(path, "the budget registry records this file as released by a run on it")
    known = ours | {known_released_id(db, d) for d in ours}
    named = _report_dataset_id(path.parent)
    if named is not None and named in known:
        raise _same_dataset(path, f"the report beside it names dataset {named}")
    # The run's own ledger beside the file (a run folder, or a copy of model.pt with its ledger), its
    # run recorded in another registry: refused here, before reading, not by refuse_same_dataset after
    # the data is read and charged (review revJ J9).
    for header in _run_headers(path.parent):
        charged = header.get("budget_dataset_id")
        if isinstance(charged, str) and charged in known:
            raise _same_dataset(path, f"the run's ledger beside it was charged to dataset {charged}")


def refuse_same_dataset(
    checkpoint: Checkpoint, data_sha256: str, dataset_ids: set[str], data_name: str | None = None
) -> None:
    """Refuse a checkpoint from a veil run on this same dataset (see the module doc): the same data
    fingerprint, budget-registry identity or dataset name (conservative: a file edited since has
    the same name and most of the same rows)."""
    same_data = data_sha256 in checkpoint.run_dataset_sha256s
    same_id = bool(checkpoint.run_dataset_ids & dataset_ids)
    same_name = data_name is not None and checkpoint.run_dataset_name == data_name
    if same_data or same_id or same_name:
        raise _same_dataset(checkpoint.path, checkpoint.run_dataset_name)


def parameterised_layers(net: nn.Module) -> list[str]:
    """Names of the modules with parameters of their own, in registration order."""
    return [name for name, m in net.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _copy_weights(net: nn.Module, checkpoint: Checkpoint, classifier: str) -> list[str]:
    """Copy the checkpoint into ``net`` (strict names and shapes); a classifier of another shape is
    left as initialised. Returns the names re-initialised."""
    own = net.state_dict()
    missing = [k for k in own if k not in checkpoint.state]
    extra = [k for k in checkpoint.state if k not in own]
    if missing or extra:
        what = (f"lacks {', '.join(missing[:4])}" if missing else "") + (
            f"{'; ' if missing else ''}has weights this model lacks: {', '.join(extra[:4])}" if extra else ""
        )
        raise ConfigError(
            "init_from",
            str(checkpoint.path),
            f"its weights do not fit the configured model (it {what})",
            "pass the --model the checkpoint was trained with (same architecture)",
        )
    prefix = classifier + "." if classifier else ""
    reinit: list[str] = []
    load: dict[str, torch.Tensor] = {}
    for key, value in own.items():
        theirs = checkpoint.state[key]
        if theirs.shape != value.shape:
            if key.startswith(prefix) and key.count(".") == prefix.count("."):
                reinit.append(key)
                load[key] = value
                continue
            raise ConfigError(
                "init_from",
                str(checkpoint.path),
                f"'{key}' has shape {tuple(theirs.shape)} there and {tuple(value.shape)} in this model",
                "pass the --model the checkpoint was trained with; only the classifier may differ "
                "(another class count)",
            )
        load[key] = theirs.to(value.dtype)
    net.load_state_dict(load)
    return reinit


class FrozenLayers(nn.Sequential):
    """Pretrained layers as a fixed map: their parameters held as buffers (saved with the model,
    never trained), always in eval mode, so the map is deterministic and per-example whenever its
    layers are (the engine's example-mixing probe checks the whole model)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__(*layers)
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                del module._parameters[name]
                module.register_buffer(name, p.detach())
        super().train(False)

    def train(self, mode: bool = True) -> FrozenLayers:
        return super().train(False)


def _leaves(net: nn.Module) -> list[nn.Module] | None:
    """``net`` as the flat list of the layers of nested plain ``nn.Sequential`` containers, or None."""
    from veil.models import FixedFeaturesThenHead

    if type(net) not in (nn.Sequential, FixedFeaturesThenHead):
        return None
    out: list[nn.Module] = []
    for child in net.children():
        inner = _leaves(child) if isinstance(child, nn.Sequential) else [child]
        if inner is None:
            return None
        out.extend(inner)
    return out


def start_from(
    net: nn.Module, checkpoint: Checkpoint, fine_tune: str, last_k: int = 2
) -> tuple[nn.Module, StartedFrom]:
    """``net`` with the checkpoint's weights, restructured for ``fine_tune`` (see the module doc)."""
    from veil.models import FixedFeaturesThenHead

    if fine_tune not in FINE_TUNE_VISION:
        raise ConfigError(
            "fine_tune", fine_tune, "with --init-from, a model is fine-tuned", "use head, last-k or full"
        )
    layers = parameterised_layers(net)
    if not layers:
        raise ConfigError("init_from", str(checkpoint.path), "the model has no parameters", "pick a model")
    done = StartedFrom(reinitialised=_copy_weights(net, checkpoint, layers[-1]))
    k = {"head": 1, "full": len(layers)}.get(fine_tune, last_k)
    if k < 1:
        raise ConfigError("last_k", k, "at least one layer must be trained", "pass --last-k 1 or more")
    k = min(k, len(layers))
    done.trained, done.frozen = layers[-k:], layers[:-k]
    if not done.frozen:
        return net, done
    modules = dict(net.named_modules())
    first = modules[done.trained[0]]
    leaves = _leaves(net)
    if leaves is not None and any(m is first for m in leaves):
        cut = next(i for i, m in enumerate(leaves) if m is first)
        done.fixed_front = True
        return FixedFeaturesThenHead(FrozenLayers(leaves[:cut]), nn.Sequential(*leaves[cut:])), done
    for name in done.frozen:
        for p in modules[name].parameters(recurse=False):
            p.requires_grad_(False)
    return net, done


_READ: dict[tuple[str, int, int], Checkpoint] = {}


def _read_cached(spec: str) -> Checkpoint:
    """:func:`read_checkpoint`, once per file version in a process (a run builds its network several
    times: the checks, the private model, the evaluation copy, the baseline)."""
    file = _weights_path(spec)
    try:
        stat = file.stat()
    except OSError:
        return read_checkpoint(spec)
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _READ:
        _READ.clear()
        _READ[key] = read_checkpoint(spec)
    return _READ[key]


def _dataset_ids(cfg: Any, data_sha256: str) -> set[str]:
    ids = {f"sha256:{data_sha256}"}
    from veil.errors import VeilError
    from veil.registry.identity import dataset_identity

    # An unidentifiable dataset is refused by the loader or the registry, not here.
    with contextlib.suppress(VeilError):
        where = {"table": cfg.table, "query": cfg.query, "data_dir": cfg.data_dir}
        ids.add(dataset_identity(cfg.dataset, dataset_id=cfg.dataset_id, **where).id)
    return ids


def pipeline_net(cfg: Any, data: Any, net: nn.Module) -> nn.Module:
    """``veil train --init-from``: ``net`` (validated, initialised from the seed) started from the
    checkpoint and restructured for ``cfg.fine_tune``; a checkpoint from a veil run on this dataset
    is refused. The report's ``pretrained`` section is kept on the network as ``veil_pretrained``."""
    if cfg.fine_tune == "lora":
        raise ConfigError(
            "fine_tune",
            "lora",
            "LoRA adapters are for Hugging Face models",
            "use --fine-tune head, last-k or full with --init-from, or --model hf:DIR for LoRA",
        )
    from veil.models import FixedFeaturesThenHead

    checkpoint = _read_cached(cfg.init_from)
    if checkpoint.from_veil_run:
        refuse_same_dataset(checkpoint, data.sha256, _dataset_ids(cfg, data.sha256), data.name)
    net, done = start_from(net, checkpoint, cfg.fine_tune, cfg.last_k)
    net.veil_pretrained = {  # type: ignore[assignment]
        "checkpoint": str(checkpoint.path),
        "sha256": checkpoint.sha256,
        "declared_public_by": "--init-from (public by declaration: trained without this dataset's rows)",
        "source_run_dataset": checkpoint.run_dataset_name,
        "fine_tune": cfg.fine_tune + (f" (k = {cfg.last_k})" if cfg.fine_tune == "last-k" else ""),
        "trained_layers": done.trained,
        "frozen_layers": done.frozen,
        "reinitialised": done.reinitialised,
        "features_computed_once": isinstance(net, FixedFeaturesThenHead),
    }
    return net


def refuse_without_checkpoint(cfg: Any) -> None:
    """``--fine-tune last-k`` needs pretrained weights; ``lora`` needs a Hugging Face model."""
    if cfg.fine_tune == "last-k":
        raise ConfigError(
            "fine_tune",
            "last-k",
            "fine-tuning the last layers starts from pretrained weights, and none were given",
            "pass --init-from CHECKPOINT (public weights), or drop --fine-tune",
        )
    if cfg.fine_tune == "lora":
        raise ConfigError(
            "fine_tune",
            "lora",
            "LoRA adapters are for Hugging Face models",
            "pass --model hf:DIR, or drop --fine-tune",
        )
