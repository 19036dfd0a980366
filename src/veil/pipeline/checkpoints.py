"""Checkpoints and resume of a training run: written atomically, recorded (with their sha256) in the
ledger, verified before they are used.

Guarantee relied on by resume: a checkpoint or released preprocessing statistic is used only if its
sha256 matches the one the ledger recorded, and a resumed run continues only with the settings, data
and fixed feature front it was accounted with (:func:`check_overrides`, :func:`check_header`,
:func:`check_front_fingerprint`); every check runs before anything is written.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.accounting.ledger import Ledger, atomic_write_bytes, file_sha256
from veil.config import PRIVACY_KEYS, TrainConfig
from veil.errors import CheckpointError
from veil.pipeline.run_folder import CHECKPOINTS, LEDGER

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CKPT_FORMAT",
    "HEADER_KEYS",
    "RESUME_MUTABLE",
    "check_front_fingerprint",
    "check_header",
    "check_overrides",
    "front_fingerprint",
    "intact",
    "load_checkpoint",
    "save_checkpoint",
    "verified_preprocessing_file",
    "verify_files",
]

CKPT_FORMAT = "veil.train.checkpoint/1"
_KEEP_CHECKPOINTS = 2
# Settings that may differ on --resume: they cannot change what was or will be charged.
RESUME_MUTABLE = frozenset(
    {
        "out",
        "progress",
        "baseline",
        "device",
        "physical_batch_size",
        "checkpoint_every",
        "stream",
        "stream_rows",
    }
)
HEADER_KEYS = (
    "accountant",
    "target_epsilon",
    "delta",
    "noise_multiplier",
    "max_grad_norm",
    "sampling_rate",
    "batch_size",
    "steps_planned",
    "dataset_sha256",
    "n_train",
    "preprocessing",
    "preprocessing_event",
    "whitening_event",  # absent (None) where the run has no whitening release
    "step_event",
    "secure_rng",
    "privacy_unit",  # absent (None) in a row-level run's header, old or new
    "max_rows_per_unit",
)


def save_checkpoint(run_dir: Path, ledger: Ledger, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically, then record its sha256 in the ledger; keep the last two."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    folder = run_dir / CHECKPOINTS
    folder.mkdir(exist_ok=True)
    name = f"step-{state['charged']:07d}.pt"
    atomic_write_bytes(folder / name, data)
    ledger.append(
        "checkpoint",
        charged=state["charged"],
        applied=state["applied"],
        file=f"{CHECKPOINTS}/{name}",
        sha256=hashlib.sha256(data).hexdigest(),
    )
    keep = {r["file"] for r in list(ledger.of_kind("checkpoint"))[-_KEEP_CHECKPOINTS:]}
    for old in folder.glob("step-*.pt"):
        if f"{CHECKPOINTS}/{old.name}" not in keep:
            old.unlink(missing_ok=True)


def load_checkpoint(run_dir: Path, ledger: Ledger) -> dict[str, Any] | None:
    """The last checkpoint the ledger recorded, verified against its sha256; None if there is none."""
    import torch

    record = ledger.last("checkpoint")
    if record is None:
        return None
    path = run_dir / record["file"]
    fix = (
        "restore the checkpoint from a backup, then --resume (the ledger keeps the spent budget; a new "
        "run on the same data spends it again, so count it with `veil budget`)"
    )
    if not path.is_file():
        raise CheckpointError(
            "checkpoint", str(path), "the checkpoint the ledger recorded last is missing", fix
        )
    if file_sha256(path) != record["sha256"]:
        raise CheckpointError(
            "checkpoint",
            str(path),
            "its sha256 does not match the one recorded in the ledger: it is corrupted or was replaced",
            fix,
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pragma: no cover - the checksum matched, so this is a version problem
        raise CheckpointError("checkpoint", str(path), f"it cannot be read ({exc})", fix) from None
    if not isinstance(state, dict) or state.get("format") != CKPT_FORMAT:
        raise CheckpointError("checkpoint", str(path), "not a veil training checkpoint", fix)
    return state


def front_fingerprint(net: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor | None:
    """A fixed feature map's output on a public probe (uniform noise in [0, 1) from a constant seed:
    no private data), or None for a model without one. The map is rebuilt, not saved, when a run
    resumes, and a checkpointed head only fits the features it was trained on."""
    import torch

    from veil.models import FixedFeaturesThenHead

    if not isinstance(net, FixedFeaturesThenHead):
        return None
    probe = torch.rand((2, *input_shape), generator=torch.Generator().manual_seed(0))
    device = next(iter(net.features.buffers()), probe).device
    with torch.no_grad():
        return net.features(probe.to(device)).double().cpu()


def check_front_fingerprint(state: dict[str, Any], now: torch.Tensor | None, run_dir: Path) -> None:
    import torch

    if "front_fingerprint" not in state:  # a checkpoint written before veil recorded one
        return
    before = state["front_fingerprint"]
    same = (before is None and now is None) or (
        before is not None
        and now is not None
        and before.shape == now.shape
        and bool(torch.allclose(before, now, rtol=1e-4, atol=1e-6))
    )
    if not same:
        raise CheckpointError(
            "checkpoint",
            str(run_dir),
            "the model's fixed feature front, rebuilt now, differs from the one the checkpointed head "
            "was trained on (another model setting, or another torch version drawing its random features)",
            "resume with the run's own config.toml and the torch version that started it",
        )


def intact(run_dir: Path) -> bool:
    """Whether the ledger ends with a complete line (else an interrupted append awaits its repair)."""
    data = (run_dir / LEDGER).read_bytes()
    return not data or data.endswith(b"\n")


def verify_files(run_dir: Path, ledger: Ledger | None) -> None:
    """Refuse a resume whose recorded checkpoint or preprocessing file is missing or altered (no writes)."""
    if ledger is None:
        return
    load_checkpoint(run_dir, ledger)
    verified_preprocessing_file(run_dir, ledger)


def verified_preprocessing_file(run_dir: Path, ledger: Ledger, kind: str = "preprocessing") -> Path | None:
    """The recorded release of this run before its steps (checksum verified), or None if none was made:
    ``kind`` is the ledger record that names its file (``preprocessing``, or ``whitening``: the
    scattering preset's released Gram matrix, :mod:`veil.data.whitening`)."""
    done = ledger.last(kind)
    if done is None:
        return None
    path = run_dir / done["file"]
    if not path.is_file() or file_sha256(path) != done["sha256"]:
        raise CheckpointError(
            kind,
            str(path),
            f"the released {kind} statistic is missing or does not match its checksum",
            "restore it from a backup, then --resume (its release is already charged in the ledger)",
        )
    return path


def check_overrides(saved: TrainConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a resume may change (performance only); refuse any other change by name."""
    update: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None or key in ("resume",):
            continue
        if key in RESUME_MUTABLE:
            update[key] = value
        elif getattr(saved, key) != value:
            kind = "privacy setting" if key in PRIVACY_KEYS else "setting"
            raise CheckpointError(
                key,
                value,
                f"resuming with a changed {kind}: the run was planned "
                f"and accounted with {key}={getattr(saved, key)!r}",
                f"--resume without changing {key} (the spent budget was planned with the recorded value)",
            )
    return update


def check_header(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Refuse a resume whose ledger header differs from the run as it would continue now."""
    for key in HEADER_KEYS:
        if recorded.get(key) != now[key]:
            raise CheckpointError(
                f"ledger header {key}",
                recorded.get(key),
                f"the run was accounted with {key}={recorded.get(key)!r} "
                "but would now continue with "
                f"{now[key]!r} (changed data, settings or veil version)",
                "restore the original data and settings, then --resume (the budget it spent stays spent)",
            )
