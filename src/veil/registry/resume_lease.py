"""One continuation per run: which copy of a run folder may resume it, and never from an older ledger.

Why. A resumable job (``veil train``, ``veil federated``) keeps its run's state in its folder (ledger,
checkpoints) and its charge in the registry under one run id. A folder is just files: copied (``cp
-r``) or restored from a backup, two folders hold the same run id. Without a rule, each copy resumed
trains on with fresh noise — two releases of the same data for one charge — and a copy holding an
older ledger, resumed after the run finished, re-settled the run at its shorter ledger: a refund after
the full model was released (revD's F1).

The rule, enforced by :func:`veil.registry.transactions.reopen` in the same transaction that
re-admits the plan:

* **generation.** The registry keeps, per run, the number of times it was resumed; the folder keeps
  the number it last took (``resume.lease``, written by :func:`take` right after the registry
  granted it). A folder whose number is not the registry's is a copy that another continuation
  overtook: refused, nothing charged or changed. Two copies of one folder: the first resumed wins.
* **ledger length.** The registry keeps the length of the run's ledger (its records) when it last
  settled; a folder whose ledger is shorter is an older copy (or a truncated ledger: every prefix of
  the unkeyed hash chain is a valid ledger): refused.

So a run id is continued by one folder at a time, from a state no older than the one it was charged
for, and a charge settled once is never re-settled from a stale copy. The assumption: the folder's
files are copied, restored or truncated, not forged (an operator who writes a longer ledger by hand
is outside what any file-based check sees). Not covered: a folder copied, then the original killed
before it settled and never resumed — the copy may continue from its earlier state while the
original's later checkpoints stay on disk (internal files, never in ``release/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LEASE_FILE", "ResumeLease", "held", "take"]

LEASE_FILE = "resume.lease"
"""The run folder's record of the continuation it holds (JSON ``{"run_id", "generation"}``)."""


@dataclass(frozen=True)
class ResumeLease:
    """What a run folder claims when it resumes: the continuation it last held and its ledger's length."""

    generation: int
    ledger_records: int


def held(run_dir: Path, run_id: str, ledger_records: int) -> ResumeLease:
    """The lease ``run_dir`` holds for ``run_id`` (generation 0 when it never resumed it)."""
    path = Path(run_dir) / LEASE_FILE
    try:
        saved = json.loads(path.read_text())
        generation = int(saved["generation"]) if saved.get("run_id") == run_id else 0
    except FileNotFoundError:
        generation = 0
    except (OSError, ValueError, KeyError, TypeError):
        generation = -1  # unreadable: matches no generation the registry holds, so it is refused
    return ResumeLease(generation, ledger_records)


def take(run_dir: Path, run_id: str, lease: ResumeLease) -> None:
    """Record in ``run_dir`` the continuation the registry just granted (``lease.generation + 1``)."""
    from veil.accounting.ledger import atomic_write_text

    atomic_write_text(
        Path(run_dir) / LEASE_FILE, json.dumps({"run_id": run_id, "generation": lease.generation + 1}) + "\n"
    )
