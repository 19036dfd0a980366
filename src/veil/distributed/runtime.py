"""Where this process stands in a run: its rank, the world size, and whether it writes the run's files.

Rank 0 alone writes the ledger, checkpoints and report of a distributed run (one writer: no two
processes race on one file, and the ledger has exactly one entry per step). A one-process run is its
own writer. Nothing here starts or joins a process group.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["is_writer", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """True on the one process that writes the run's files (rank 0, or the only process)."""
    return rank_and_world()[0] == 0
