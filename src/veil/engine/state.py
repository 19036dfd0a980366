"""Checkpoint state: the engine's resumable state as a plain dict, and its checked restore.

What is saved: the plan, the step count, the accountant's ledger (run-length encoded JSON events),
the randomness mode and the sampler's position; in research (seeded) mode only, the generators'
states too. A secure engine's state holds no generator state (the OS CSPRNG cannot be replayed), so a
reader of a checkpoint learns nothing about the noise; a resume draws fresh noise and fresh batches.
A restore checks everything (same plan, readable ledger) before anything changes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, NamedTuple

from veil.accounting.base import AccountantName, PrivacyAccountant, make_accountant
from veil.accounting.events import PrivacyEvent, event_from_dict
from veil.errors import CheckpointError
from veil.mechanisms.rng import RandomSource
from veil.optimizer import DPOptimizer
from veil.plan import PrivacyPlan
from veil.sampling import PrivateDataLoader

__all__ = ["STATE_FORMAT", "Restored", "read_state", "write_state"]

STATE_FORMAT = "veil.engine/1"


def _run_length(events: tuple[PrivacyEvent, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous: PrivacyEvent | None = None
    for event in events:
        if previous is not None and event == previous:
            out[-1]["count"] += 1
        else:
            out.append({"event": event.to_dict(), "count": 1})
            previous = event
    return out


def write_state(
    plan: PrivacyPlan,
    steps: int,
    accountant: PrivacyAccountant,
    randomness: str,
    optimizer: DPOptimizer,
    loader: PrivateDataLoader,
    noise_source: RandomSource,
) -> dict[str, Any]:
    """The state dict (see the module docstring); refused in the middle of a logical batch."""
    if optimizer.pending_chunks:
        raise CheckpointError(
            "engine",
            f"{optimizer.pending_chunks} chunk(s) pending",
            "a logical batch is half accumulated; its per-sample state is not saved",
            "save right after the optimizer step that closes a logical batch",
        )
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "plan": asdict(plan),
        "steps": steps,
        "ledger": _run_length(accountant.ledger.events),
        "randomness": randomness,
        "sampler": loader.state_dict(),
    }
    if randomness == "seeded":
        state["noise_rng"] = noise_source.state_dict()
    else:
        state["sampler"] = {**state["sampler"], "rng": None}
    return state


class Restored(NamedTuple):
    """A checked state, ready to apply: the rebuilt accountant, the steps, the sampler's token and
    the noise generator's state, restored only when both the saved and the resuming engine are seeded."""

    accountant: PrivacyAccountant
    steps: int
    sampler: dict[str, Any]
    restore_rng: bool
    noise_rng: Any


def _check_plan(state: Any, plan: PrivacyPlan) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(
            "state.format",
            state.get("format") if isinstance(state, dict) else type(state).__name__,
            "not an engine state this version can read",
            "pass the dict returned by PrivacyEngine.state_dict()",
        )
    saved_plan = state.get("plan")
    if isinstance(saved_plan, dict):  # a state saved before privacy units: a row-level plan
        saved_plan = {"privacy_unit": "row", "max_rows_per_unit": None, **saved_plan}
    if saved_plan != asdict(plan):
        raise CheckpointError(
            "state.plan",
            saved_plan,
            f"the privacy settings differ from this engine's {asdict(plan)}, so the saved ledger "
            "would be continued with different events",
            "call make_private with the same settings (σ or targets, C, batch size, dataset, sampling)",
        )


def read_state(state: Any, plan: PrivacyPlan, accountant_name: AccountantName, randomness: str) -> Restored:
    """Check ``state`` against this engine's plan and rebuild its accountant; nothing changes here."""
    _check_plan(state, plan)
    try:
        accountant = make_accountant(accountant_name)
        for record in state["ledger"]:
            accountant.compose(event_from_dict(record["event"]), int(record["count"]))
        steps = int(state["steps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            "state.ledger",
            type(exc).__name__,
            "the saved privacy history is unreadable",
            "pass an intact state",
        ) from exc
    saved_randomness = state.get("randomness", "secure" if state.get("secure_rng", False) else "seeded")
    restore_rng = randomness == "seeded" and saved_randomness == "seeded"
    sampler_token = dict(state["sampler"])
    if not restore_rng:
        sampler_token["rng"] = None
    return Restored(
        accountant, steps, sampler_token, restore_rng, state["noise_rng"] if restore_rng else None
    )
