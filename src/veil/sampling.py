"""Batch sampling for DP-SGD: Poisson sampling, the opt-in shuffled loader, logical vs physical batches.

Two kinds of batch:

* a **logical batch** is what one optimizer update sees and what the accountant accounts for. With
  :class:`PoissonBatchSampler` every example joins every logical batch independently with
  probability ``q``; the batch size is random and may be 0. That independence is what the
  ``PoissonSampled(q, Gaussian(σ))`` event of each step assumes (add/remove-one neighbouring).
* a **physical batch** is a chunk of a logical batch small enough for memory. Splitting a logical batch
  into physical ones changes nothing private: the engine adds noise once per logical batch.

:class:`PrivateDataLoader` is the loader :meth:`veil.PrivacyEngine.make_private` returns: it yields
physical batches in order and tells the optimizer (through a :class:`StepSignal`) whether the batch
it just yielded closes its logical batch, and how many chunks and logical batches it has handed out
(the optimizer takes one step per chunk, so one release per logical batch). It also remembers the
sampler state *as consumed by the training loop* (not as prefetched by workers), so a checkpoint
resumes on the exact next batch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from veil.errors import InvalidParameterError, SamplingError

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "EmptyBatchCollate",
    "LogicalBatchSampler",
    "PoissonBatchSampler",
    "PrivateDataLoader",
    "ShuffledBatchSampler",
    "StepSignal",
    "check_sampling_rate",
    "split_logical_batch",
    "steps_per_epoch",
]

# A resume token: the sampler state right after a logical batch was consumed.
Token = dict[str, Any]


def _check_positive_int(name: str, value: Any, fix: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        why = "it must be a positive whole number" if least == 1 else "it must be a whole number ≥ 0"
        raise InvalidParameterError(name, value, why, fix)
    return value


class LogicalBatchSampler(Protocol):
    """What :class:`PrivateDataLoader` needs from a sampler of logical batches."""

    steps_per_epoch: int

    def logical_batches(self) -> Iterator[tuple[list[int], Token]]:
        """One epoch of logical batches, each with the token that resumes right after it."""
        ...

    def token(self) -> Token:
        """The token that resumes at the sampler's current position."""
        ...

    def load_token(self, token: Token) -> None:
        """Resume from a token: the next epoch starts where the token says."""
        ...


class _TokenMixin:
    """Shared batch iteration and resume logic: an RNG state plus a position within the epoch."""

    rng: RandomSource
    steps_per_epoch: int
    _start: int

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for indices, _ in self.logical_batches():
            yield indices

    def logical_batches(self) -> Iterator[tuple[list[int], Token]]:
        """(indices, resume token) for each remaining logical batch of the epoch."""
        return self._generate(self._take_start())

    def _generate(self, start: int) -> Iterator[tuple[list[int], Token]]:
        raise NotImplementedError

    def _rng_state(self) -> Any:
        return None if self.rng.secure else self.rng.state_dict()

    def token(self) -> Token:
        return {"rng": self._rng_state(), "position": self._start}

    def load_token(self, token: Token) -> None:
        position = token.get("position", 0)
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or not 0 <= position < self.steps_per_epoch
        ):
            raise InvalidParameterError(
                "sampler.position",
                position,
                "a resume position must lie inside the epoch",
                "pass a token saved by the same engine configuration",
            )
        if token.get("rng") is not None and not self.rng.secure:
            self.rng.load_state_dict(token["rng"])
        self._start = position

    def _take_start(self) -> int:
        start, self._start = self._start, 0
        return start


class PoissonBatchSampler(_TokenMixin, Sampler[list[int]]):
    """Poisson sampling: each example joins each logical batch independently with probability ``q``.

    Guarantee: for every step and every example the inclusion indicator is an independent
    Bernoulli(q) draw from ``rng`` (the accountant's ``PoissonSampled(q, ·)`` assumption).
    Batch sizes are random (Binomial(N, q)) and empty batches are yielded like any other: skipping them
    would change the sampling distribution. ``len(sampler)`` is ``steps_per_epoch``, the number of
    logical batches per epoch. ``dataset_size`` 0 is allowed (every batch empty): a part whose exact
    size is private may be empty, and its steps are still taken (``make_private(population=)``).
    """

    def __init__(
        self, dataset_size: int, sampling_rate: float, steps_per_epoch: int, rng: RandomSource
    ) -> None:
        self.dataset_size = _check_positive_int(
            "dataset_size", dataset_size, "pass the number of examples sampled from (≥ 0)", least=0
        )
        q = sampling_rate
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise InvalidParameterError(
                "sampling_rate",
                q,
                "an inclusion probability must lie in (0, 1]",
                "pass q = expected batch size / dataset size",
            )
        self.sampling_rate = float(q)
        self.steps_per_epoch = _check_positive_int(
            "steps_per_epoch", steps_per_epoch, "pass the number of logical batches per epoch (≥ 1)"
        )
        self.rng = rng
        self._start = 0

    def _generate(self, start: int) -> Iterator[tuple[list[int], Token]]:
        for k in range(start, self.steps_per_epoch):
            mask = np.asarray(self.rng.bernoulli(self.dataset_size, self.sampling_rate), dtype=bool)
            indices = np.flatnonzero(mask).tolist()
            yield indices, {"rng": self._rng_state(), "position": (k + 1) % self.steps_per_epoch}


class ShuffledBatchSampler(_TokenMixin, Sampler[list[int]]):
    """Fixed-size batches from a fresh uniform permutation each epoch (the opt-in, non-amplified loader).

    Each epoch draws a uniform permutation (argsort of i.i.d. float64 normals from ``rng``) and cuts it into
    ``steps_per_epoch`` consecutive batches of ``batch_size`` (the last may be smaller; examples past
    ``steps_per_epoch × batch_size`` are not used that epoch). No amplification by sampling may be
    claimed for this sampler; see :mod:`veil.engine` for how its steps are accounted.
    """

    def __init__(self, dataset_size: int, batch_size: int, steps_per_epoch: int, rng: RandomSource) -> None:
        self.dataset_size = _check_positive_int("dataset_size", dataset_size, "pass a non-empty dataset")
        self.batch_size = _check_positive_int("batch_size", batch_size, "pass a batch size ≥ 1")
        self.steps_per_epoch = _check_positive_int(
            "steps_per_epoch", steps_per_epoch, "pass the number of batches per epoch (≥ 1)"
        )
        self.rng = rng
        self._start = 0

    def _generate(self, start: int) -> Iterator[tuple[list[int], Token]]:
        epoch_state = self._rng_state()
        order = np.argsort(self.rng.standard_normal(self.dataset_size), kind="stable").tolist()
        b = self.batch_size
        for k in range(start, self.steps_per_epoch):
            if k + 1 == self.steps_per_epoch:
                token = {"rng": self._rng_state(), "position": 0}
            else:
                token = {"rng": epoch_state, "position": k + 1}
            yield order[k * b : (k + 1) * b], token


def split_logical_batch(indices: Sequence[int], physical_batch_size: int | None) -> list[list[int]]:
    """Physical chunks of one logical batch, in order; always at least one (possibly empty) chunk.

    A batch grouped by privacy unit (an object with a ``units`` list, :class:`veil.units.UnitBatch`)
    is cut between units only, never inside one (a unit is clipped as a whole): each chunk holds
    whole units and at most ``physical_batch_size`` rows unless one unit alone has more. Its chunks
    carry their own ``units`` labels, renumbered from 0."""
    units = getattr(indices, "units", None)
    if units is not None:
        return _split_by_unit(indices, units, physical_batch_size)
    if physical_batch_size is None or len(indices) <= physical_batch_size:
        return [list(indices)]
    p = physical_batch_size
    return [list(indices[i : i + p]) for i in range(0, len(indices), p)]


class _UnitChunk(list[int]):
    """A physical chunk of whole units: row indices and each row's unit label (from 0)."""

    def __init__(self, rows: Sequence[int], units: Sequence[int]) -> None:
        super().__init__(rows)
        first = units[0] if len(units) else 0
        self.units = [u - first for u in units]


def _split_by_unit(
    rows: Sequence[int], units: Sequence[int], physical_batch_size: int | None
) -> list[list[int]]:
    if physical_batch_size is None or len(rows) <= physical_batch_size:
        return [_UnitChunk(rows, units)]
    chunks: list[list[int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        boundary = i == len(rows) or units[i] != units[i - 1]
        if not boundary:
            continue
        if i == len(rows) or i - start + _unit_length(units, i) > physical_batch_size:
            chunks.append(_UnitChunk(rows[start:i], units[start:i]))
            start = i
    return chunks


def _unit_length(units: Sequence[int], i: int) -> int:
    """Rows of the unit starting at row ``i`` (rows of a unit are consecutive)."""
    j = i
    while j < len(units) and units[j] == units[i]:
        j += 1
    return j - i


@dataclass
class StepSignal:
    """Shared between the loader and the optimizer: what the loader handed out last.

    ``last_chunk``: does the chunk just yielded close its logical batch? ``chunks``: chunks handed out
    so far; ``logical_batches``: logical batches begun so far (the serial of the chunk's logical
    batch). The optimizer takes one ``step()`` per chunk handed out and refuses a step with no new
    chunk since its previous one (:meth:`veil.optimizer.DPOptimizer.step`), so each release closes a
    logical batch drawn for it alone; it drops the clipped sums of a logical batch left unreleased
    when a chunk of a later one arrives. Counters only: they depend on the calls, never on a row.
    """

    last_chunk: bool = True
    chunks: int = 0
    logical_batches: int = 0

    def hand_out(self, *, first: bool, last: bool) -> None:
        """A chunk was handed to the training loop: ``first``/``last`` chunk of its logical batch."""
        self.chunks += 1
        if first:
            self.logical_batches += 1
        self.last_chunk = last


class _Chunk(NamedTuple):
    """What the chunker records for each chunk it yields, read back when the loop receives it."""

    first: bool
    last: bool
    token: Token
    units: list[int] | None


class _ChunkingBatchSampler(Sampler[list[int]]):
    """Turns logical batches into physical chunks; records, per chunk, its place in its logical batch
    (first? last?), the resume token and the unit labels."""

    def __init__(self, logical: LogicalBatchSampler, physical_batch_size: int | None) -> None:
        self.logical = logical
        self.physical_batch_size = physical_batch_size
        self.queue: deque[_Chunk] = deque()

    def __len__(self) -> int:
        return self.logical.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        # Eager (not a generator): the DataLoader iterator is built right after this call, and the
        # loader picks up *this* queue, so an abandoned earlier iteration cannot misalign flags.
        self.queue = deque()
        return self._chunks(self.logical.logical_batches(), self.queue)

    def _chunks(
        self, batches: Iterator[tuple[list[int], Token]], queue: deque[_Chunk]
    ) -> Iterator[list[int]]:
        for indices, token in batches:
            chunks = split_logical_batch(indices, self.physical_batch_size)
            for i, chunk in enumerate(chunks):
                queue.append(_Chunk(i == 0, i == len(chunks) - 1, token, getattr(chunk, "units", None)))
                yield list(chunk)


def _empty_like_batch(value: Any) -> Any:
    """The 0-example version of a collated batch of one example."""
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, np.ndarray):
        return value[:0]
    if isinstance(value, Mapping):
        return type(value)({k: _empty_like_batch(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple of fields
        return type(value)(*(_empty_like_batch(v) for v in value))
    if isinstance(value, (list, tuple)):
        structural = all(isinstance(v, (torch.Tensor, np.ndarray, Mapping, list, tuple)) for v in value)
        if structural and value:
            return type(value)(_empty_like_batch(v) for v in value)
        return type(value)()  # a batch list of plain values (e.g. strings): empty
    return value


class EmptyBatchCollate:
    """Wraps a collate function so that a batch of 0 examples collates to tensors of shape ``[0, ...]``.

    The shapes come from collating one dataset item (``template_item``) and slicing to 0 rows, so an
    empty Poisson batch flows through the user's model and loss like any other. Picklable (workers).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], template_item: Any) -> None:
        self.collate_fn = collate_fn
        self.empty = _empty_like_batch(collate_fn([template_item]))

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) == 0:
            return self.empty
        return self.collate_fn(batch)


class _SignallingIterator:
    """Iterates the underlying DataLoader iterator and raises the flags the optimizer reads."""

    def __init__(
        self,
        loader: PrivateDataLoader,
        inner: Iterator[Any],
        queue: deque[_Chunk],
    ) -> None:
        self._loader = loader
        self._inner = inner
        self._queue = queue

    def __iter__(self) -> _SignallingIterator:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        batch = next(self._inner)
        chunk = self._queue.popleft()
        self._loader.signal.hand_out(first=chunk.first, last=chunk.last)
        if self._loader.on_units is not None:  # privacy units: the clipper learns this chunk's rows
            self._loader.on_units(chunk.units)
        if chunk.last:
            self._loader.consumed_token = chunk.token
        return batch


class PrivateDataLoader(DataLoader):
    """The loader ``make_private`` returns: physical batches of Poisson (or opt-in shuffled) logical batches.

    ``len(loader)`` is the number of **logical** batches (optimizer updates) per epoch. Without
    ``physical_batch_size`` that is also the number of batches iterated; with it, each logical batch is
    yielded as one or more chunks of at most ``physical_batch_size`` examples (an empty logical batch as
    one empty chunk), so iteration yields at least ``len(loader)`` batches.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        logical_sampler: LogicalBatchSampler,
        *,
        expected_batch_size: int,
        physical_batch_size: int | None,
        signal: StepSignal,
        collate_fn: Callable[[list[Any]], Any],
        template_item: Any,
        **loader_kwargs: Any,
    ) -> None:
        chunker = _ChunkingBatchSampler(logical_sampler, physical_batch_size)
        super().__init__(
            dataset,
            batch_sampler=chunker,
            collate_fn=EmptyBatchCollate(collate_fn, template_item),
            **loader_kwargs,
        )
        self.logical_sampler = logical_sampler
        self.expected_batch_size = expected_batch_size
        self.physical_batch_size = physical_batch_size
        self.signal = signal
        self.consumed_token: Token = logical_sampler.token()
        self.on_units: Callable[[list[int] | None], None] | None = None
        """Called with each chunk's unit labels as it is yielded (privacy-unit mode; see veil.units)."""

    def __iter__(self) -> _SignallingIterator:  # type: ignore[override]
        inner = super().__iter__()
        chunker = self.batch_sampler
        assert isinstance(chunker, _ChunkingBatchSampler)
        return _SignallingIterator(self, inner, chunker.queue)

    def state_dict(self) -> Token:
        """Sampler state right after the last logical batch the training loop consumed."""
        return dict(self.consumed_token)

    def load_state_dict(self, token: Token) -> None:
        """Resume: the next iteration starts right after the logical batch the token was saved at."""
        self.logical_sampler.load_token(token)
        self.consumed_token = dict(token)


def steps_per_epoch(dataset_size: int, expected_batch_size: int) -> int:
    """Logical steps per epoch: ⌈N / B⌉ (one pass in expectation; never derived from ``len(loader)``)."""
    return max(1, math.ceil(dataset_size / expected_batch_size))


def check_sampling_rate(expected_batch_size: int, dataset_size: int) -> float:
    """q = B / N, refused outside (0, 1]."""
    if expected_batch_size > dataset_size:
        raise SamplingError(
            "batch_size",
            expected_batch_size,
            f"the sampling rate q = batch_size / dataset size must be ≤ 1 (the dataset has {dataset_size})",
            "use a batch size no larger than the dataset",
        )
    return expected_batch_size / dataset_size
