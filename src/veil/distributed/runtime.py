"""Where this process stands in a run: its rank, the world size, and whether it writes the run's files.

Rank 0 alone writes the ledger, checkpoints and report of a distributed run (one writer: no two
processes race on one file, and the ledger has exactly one entry per step). A one-process run is its
own writer. Nothing here starts or joins a process group, and nothing imports torch until a process
group may exist (``veil.training`` imports this module).
"""

from __future__ import annotations

import sys

from veil.errors import ConfigError

__all__ = ["is_writer", "rank_and_world", "refuse_private_preprocessing"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialised."""
    if "torch" not in sys.modules:  # no torch, so certainly no process group
        return 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """True on the one process that writes the run's files (rank 0, or the only process)."""
    return rank_and_world()[0] == 0


def refuse_private_preprocessing(public: bool) -> None:
    """Refuse a DP preprocessing release in a run across ranks.

    Each rank would release its own noisy statistic, and the model would be trained on inputs
    preprocessed with statistics only one of which the ledger charges."""
    if public or rank_and_world()[1] == 1:
        return
    raise ConfigError(
        "preprocessing",
        "a DP-released statistic",
        "across ranks every process would release its own noisy statistic while the ledger charges one",
        "declare public feature bounds (so preprocessing is public), or train in one process",
    )
