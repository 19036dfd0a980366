"""The next step's Gaussian noise, drawn ahead: used once, discarded when it no longer fits, never saved.

A secure noise draw costs time the step would otherwise wait for; it depends on nothing but the
noise's shape, standard deviation, dtype and device, so it can be made earlier: by a worker thread
while the next forward and backward run (:class:`~veil.optimizer.DPOptimizer`, one process), or
while an all-reduce is in flight (:class:`~veil.data_parallel.optimizer.DistributedDPOptimizer`).
Both keep their draws here, under the same rules:

* **exactly once**: :meth:`NoiseAhead.take` removes the draw it returns, so a draw is added to one
  step and never again; a step without a fitting draw gets a fresh one, drawn then;
* **only if it still fits**: a draw is returned only for the same group key (dtype, device), the same
  number of coordinates and the same standard deviation it was made for (bit-equal float); anything
  else (σ changed by the user, C by adaptive clipping, the parameters by a new model) discards it
  and draws fresh, so every coordinate of every step carries one ``N(0, std²)`` draw of that step's
  std;
* **never saved**: the buffer is no part of any ``state_dict`` (optimizer, engine) or checkpoint,
  so nobody who reads a checkpoint learns the noise of the step after it; a resumed run draws fresh;
* **not across a fork**: a draw made in a parent process is discarded in a forked child (which draws
  its own), so the two never add the same noise;
* **secure sources only**: the callers never draw ahead from a seeded source, whose stream order is
  what makes a research run reproducible (results identical to drawing at the step).

When it pays (:func:`worth_drawing_ahead`, the one-process default): a worker thread only saves time
if something can run it while the step computes. Parameters on an accelerator leave the host's
cores free; on the CPU, only cores torch's thread pool does not use. On a 2-core machine with torch
on both, the measured effect was none for a 22M-parameter model and a loss for a 92k-parameter MLP
(the thread and its hand-off cost more than the 0.5 ms draw), so there it is off by default.

Each draw is one release of the source (a secure source keys a fresh keystream for it), so a draw
made on a worker thread shares no key or bytes with draws made meanwhile on the main thread.

**Small draws, several steps at once** (:meth:`NoiseAhead.reserved`): a secure float32 host draw of
fewer than :data:`RESERVE_COORDINATES` / 2 coordinates (a small model, where no worker thread pays) is
made for up to :data:`RESERVE_STEPS` steps in one release, on the main thread, and each step takes
the next unused row. Measured inside a DP step (thread CPU time, a 92,162-coordinate MLP): the draw
made at the step, right after the backward pass, costs about twice its isolated time (its ~25 numpy
passes each meet cold caches); drawn for several steps at once, the later rows cost what the
isolated draw does (a step's share of draw and release fell from 0.90 to 0.63 ms at 11 steps). The rules
above hold row by row: a row is handed out once (the index moves before it is used); a reserve whose
standard deviation, size, group or process differs from the step's is discarded whole (and a key whose
reserve was discarded with rows unused — σ or C changing between steps, as under adaptive clipping —
is not reserved again in this run, so a changing std never costs several steps' draws a step); the
reserve is in no ``state_dict`` or checkpoint; rows of one release are independent coordinates of
one Gaussian vector, so the steps' noises are independent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "MIN_COORDINATES_AHEAD",
    "RESERVE_COORDINATES",
    "Finish",
    "NoiseAhead",
    "NoiseKey",
    "worth_drawing_ahead",
]

NoiseKey = tuple[torch.dtype, torch.device]
#: ``(out, lo, hi)``: finishes the slice ``out[lo:hi]`` of a host draw in place (a numpy array).
Finish = Callable[[np.ndarray, int, int], None]

#: Noise draws below this many coordinates (≈ 2.5 ms of secure noise on one idle core) are made at
#: the step: a worker thread's start and hand-off cost more than they would hide.
MIN_COORDINATES_AHEAD = 1 << 20

#: A reserve (:meth:`NoiseAhead.reserved`) holds at most this many coordinates (4 MiB of float32) and
#: at most :data:`RESERVE_STEPS` steps: a group of ``numel`` coordinates gets
#: ``min(RESERVE_STEPS, RESERVE_COORDINATES // numel)`` steps a draw, and none below 2.
RESERVE_COORDINATES = 1 << 20
#: Steps a reserve serves at most: 4 takes most of the gain (the first row costs the cold draw, the
#: next three about the isolated one) while the reserve stays 4 gradients' worth of memory (at 11
#: steps the MLP's step peak was 1.39× plain, measured with ``bench/engine.py``).
RESERVE_STEPS = 4


@dataclass(eq=False)
class _Draw:
    """One draw, made now or on a worker thread; :meth:`result` waits for it."""

    std: float
    numel: int
    pid: int = field(default_factory=os.getpid)
    done: threading.Event = field(default_factory=threading.Event)
    value: torch.Tensor | None = None
    error: BaseException | None = None

    def run(self, make: Callable[[], torch.Tensor]) -> None:
        try:
            self.value = make()
        except BaseException as exc:  # handed to whoever takes the draw
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> torch.Tensor:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


@dataclass(eq=False)
class _Reserve:
    """Rows of one host draw, one row a step; ``used`` rows are gone (handed out once)."""

    std: float
    rows: np.ndarray  # (steps, numel) float32, C-contiguous
    used: int = 0
    pid: int = field(default_factory=os.getpid)

    def fits(self, numel: int, std: float) -> bool:
        return self.pid == os.getpid() and self.std == std and self.rows.shape[1] == numel

    @property
    def left(self) -> int:
        return len(self.rows) - self.used


class NoiseAhead:
    """Draws of ``N(0, std²)`` noise per group key, made ahead and taken once (see the module docstring).

    ``draws`` counts every draw made (ahead or at the step), for tests and logs.
    """

    def __init__(self, source: RandomSource) -> None:
        self._source = source
        self._ahead: dict[NoiseKey, _Draw] = {}
        self._reserves: dict[NoiseKey, _Reserve] = {}
        self._not_reserved: set[NoiseKey] = set()  # keys whose reserve was discarded with rows unused
        self.draws = 0

    def __len__(self) -> int:
        return len(self._ahead)

    def __repr__(self) -> str:
        return f"NoiseAhead({len(self)} buffered)"

    def _make(self, key: NoiseKey, numel: int, std: float) -> Callable[[], torch.Tensor]:
        self.draws += 1
        dtype, device = key
        return lambda: self._source.normal((numel,), std, dtype=dtype, device=device)

    def take(self, key: NoiseKey, numel: int, std: float) -> torch.Tensor:
        """This step's noise for group ``key``: the buffered draw if it fits, else a fresh one.

        The buffered draw leaves the buffer here, whether it is used or discarded.
        """
        ahead = self.buffered(key, numel, std)
        return ahead if ahead is not None else self._make(key, numel, std)()

    def buffered(self, key: NoiseKey, numel: int, std: float) -> torch.Tensor | None:
        """The buffered draw for group ``key`` if it fits (``None`` otherwise), taken out of the buffer;
        a draw that does not fit is discarded here too."""
        ahead = self._ahead.pop(key, None)
        if ahead is not None and ahead.pid == os.getpid() and ahead.std == std and ahead.numel == numel:
            return ahead.result()
        return None

    def draw_now(
        self, key: NoiseKey, numel: int, std: float, then: Finish | None = None
    ) -> tuple[torch.Tensor, bool]:
        """A fresh draw for group ``key`` (never buffered) and whether ``then`` finished it.

        ``then(out, lo, hi)`` (see :meth:`~veil.mechanisms.rng.RandomSource.host_normal32`) runs on
        each finished slice while it is in the cache, where the source draws float32 noise on the host
        in pieces (the secure source); otherwise the draw is plain :meth:`take`-style noise and the
        caller finishes it itself (``False``).
        """
        if then is not None and self.finishes_in_draw(key):
            noise = self._source.host_normal32(numel, std, then)
            if noise is not None:
                self.draws += 1
                return noise, True
        return self._make(key, numel, std)(), False

    def release_into(self, key: NoiseKey, numel: int, std: float, then: Finish) -> bool:
        """A fresh draw for group ``key`` (never buffered) handed chunk by chunk to ``then(chunk, lo,
        hi)`` (:meth:`~veil.mechanisms.rng.RandomSource.host_release32`), which writes the release
        where it belongs; ``False`` (nothing drawn) where :meth:`finishes_in_draw` does not hold."""
        if not (self.finishes_in_draw(key) and self._source.host_release32(numel, std, then)):
            return False
        self.draws += 1
        return True

    def reserved(self, key: NoiseKey, numel: int, std: float) -> np.ndarray | None:
        """This step's ``N(0, std²)`` noise for group ``key``: the next unused row of a secure host
        draw made for several steps at once (module docstring, "Small draws"), as a writable float32
        numpy row the caller may overwrite; ``None`` where no reserve applies (a seeded source, not
        float32 on the host, ``numel`` ≥ :data:`RESERVE_COORDINATES` / 2, or a key whose std or size
        changed while its reserve had rows left), and the caller draws at the step.

        A reserve that does not fit the step (std, size, process) is discarded, never used; a fresh
        one is one release of the source (fresh keys), counted in :attr:`draws`.
        """
        steps = min(RESERVE_STEPS, RESERVE_COORDINATES // max(numel, 1))
        if steps < 2 or key in self._not_reserved or not (self._source.secure and self.finishes_in_draw(key)):
            return None
        reserve = self._reserves.pop(key, None)
        if reserve is not None and not reserve.fits(numel, std):
            if reserve.left and reserve.pid == os.getpid():  # std or size changes between steps here
                self._not_reserved.add(key)
                return None
            reserve = None
        if reserve is None or not reserve.left:
            drawn = self._source.host_normal32(steps * numel, std)
            if drawn is None:
                return None
            self.draws += 1
            reserve = _Reserve(std, drawn.numpy().reshape(steps, numel))
        row = reserve.rows[reserve.used]
        reserve.used += 1  # handed out once, before anyone uses it
        if reserve.left:
            self._reserves[key] = reserve
        return row

    def finishes_in_draw(self, key: NoiseKey) -> bool:
        """Whether :meth:`draw_now` can run a ``then`` on this group's draw (float32 on the host, from
        a source that draws such noise in pieces)."""
        dtype, device = key
        return dtype == torch.float32 and device.type == "cpu" and self._source.host_pieces

    def prepare(self, key: NoiseKey, numel: int, std: float, *, background: bool) -> None:
        """Draw the next step's noise for ``key`` now, or (``background``) on a worker thread."""
        draw = _Draw(std, numel)
        make = self._make(key, numel, std)
        self._ahead[key] = draw
        if background:
            # Not a daemon: at interpreter exit a daemon thread is stopped inside the sampler's native
            # code, which can abort the process; a draw is short, so the exit waits for it instead.
            threading.Thread(target=draw.run, args=(make,), name="veil-noise-ahead", daemon=False).start()
        else:
            draw.run(make)

    def peek(self, key: NoiseKey) -> tuple[float, torch.Tensor] | None:
        """``(std, draw)`` buffered for ``key`` (waiting for it), without taking it: for tests."""
        ahead = self._ahead.get(key)
        return None if ahead is None else (ahead.std, ahead.result())

    def clear(self) -> None:
        """Discard every buffered draw and reserve."""
        self._ahead.clear()
        self._reserves.clear()


def worth_drawing_ahead(devices: list[torch.device], coordinates: int | None = None) -> bool:
    """Whether a worker thread can draw noise while a step on ``devices`` computes (see module).

    ``coordinates``: the noise draw's size, when known; a draw below :data:`MIN_COORDINATES_AHEAD`
    is not worth a thread.
    """
    if coordinates is not None and coordinates < MIN_COORDINATES_AHEAD:
        return False
    if any(d.type != "cpu" for d in devices):
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch.get_num_threads() < cores
