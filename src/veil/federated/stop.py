"""Stopping a ServerApp that runs in a thread of this process (Flower's simulation engine).

Flower's ``run_simulation`` runs the ServerApp in a thread of its own and the virtual SuperNodes in
the calling (main) thread. Ctrl-C reaches the main thread: Flower stops its SuperNodes (and Ray) and
the interrupt propagates, but nothing stops the ServerApp thread, which waits for replies that never
come and keeps the process alive. :class:`ServerStop` is what the caller holds to end it:

* :meth:`ServerStop.stop` marks the run stopped and stops the Flower run the ServerApp drives with
  Flower's own ``LinkState.stop_run`` (what ``flwr stop`` does on a SuperLink): the messages in flight
  are answered with errors and no new one is accepted, so the server's wait ends at once; then it
  waits (bounded) for the ServerApp to return;
* the server (:mod:`veil.federated.server`) calls :meth:`ServerStop.check` before it charges a round
  and before it saves one, so once stopped it charges nothing more and saves no round that the stop
  cut short, and a refusal caused by the stop is not recorded as the run's error. The run folder is
  left as a crash leaves it: every charged round is in the ledger, the checkpoint is the last round
  completed, and ``--resume`` continues from there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["ServerStop", "ServerStopped"]


class ServerStopped(Exception):
    """The run was stopped by the server's caller (an interrupt): nothing more is charged or saved.

    An ``Exception`` (not a ``BaseException``), so that Flower's ServerApp thread catches it quietly."""


class ServerStop:
    """The switch between a simulated run's caller and its ServerApp thread (see the module doc)."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._ended = threading.Event()
        self._grid: Any = None

    @contextlib.contextmanager
    def serving(self, grid: Any) -> Iterator[None]:
        """Around the ServerApp's work on ``grid``: what :meth:`stop` stops, and waits for."""
        self._grid = grid
        try:
            yield
        finally:
            self._ended.set()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def check(self) -> None:
        """Raise :class:`ServerStopped` once :meth:`stop` was called."""
        if self._requested.is_set():
            raise ServerStopped("the run was stopped")

    def stop(self, timeout: float) -> bool:
        """Stop the run and wait up to ``timeout`` seconds for the ServerApp to return; True if it did
        (or never started: it stops at its first check)."""
        self._requested.set()
        grid = self._grid
        if grid is None:
            return True
        state = getattr(grid, "state", None)  # Flower's InMemoryGrid: the simulation's LinkState
        if state is not None:
            state.stop_run(grid.run.run_id)
        return self._ended.wait(timeout)
