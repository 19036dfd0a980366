"""``BatchMemoryManager``: Opacus's context manager for a physical batch size, on veil's private loader.

Inside the ``with`` block the private loader yields each logical (Poisson) batch in chunks of at most
``max_physical_batch_size`` examples; the optimizer accumulates the clipped chunks and adds noise once
per logical batch, as with ``make_private(physical_batch_size=...)``. The privacy plan (σ, C, q, the
events accounted) is unchanged: the physical size is a performance setting only. On exit the loader's
earlier physical batch size is restored.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from veil.errors import InvalidParameterError
from veil.optimizer import DPOptimizer
from veil.sampling import PrivateDataLoader, _ChunkingBatchSampler

__all__ = ["BatchMemoryManager"]


class BatchMemoryManager:
    """``with BatchMemoryManager(data_loader=, max_physical_batch_size=, optimizer=) as loader: ...``

    ``data_loader`` and ``optimizer`` must be the ones ``make_private`` returned (the optimizer is
    checked to be driven by this loader). Yields the same loader object, set to chunk its batches.
    """

    def __init__(self, *, data_loader: Any, max_physical_batch_size: int, optimizer: Any) -> None:
        if not isinstance(data_loader, PrivateDataLoader) or not isinstance(
            data_loader.batch_sampler, _ChunkingBatchSampler
        ):
            raise InvalidParameterError(
                "data_loader",
                type(data_loader).__name__,
                "only the loader make_private returned tells the optimizer where a logical batch ends",
                "pass the data loader returned by PrivacyEngine.make_private",
            )
        if not isinstance(optimizer, DPOptimizer) or optimizer._signal is not data_loader.signal:
            raise InvalidParameterError(
                "optimizer",
                type(optimizer).__name__,
                "chunks are summed into one noisy step only by the optimizer make_private returned with "
                "this loader",
                "pass the optimizer returned by the same make_private call",
            )
        size = max_physical_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidParameterError(
                "max_physical_batch_size", size, "a chunk must hold at least one example", "pass an int ≥ 1"
            )
        self.data_loader = data_loader
        self.optimizer = optimizer
        self.max_physical_batch_size = size
        self._saved: int | None = None

    def __enter__(self) -> PrivateDataLoader:
        chunker = self.data_loader.batch_sampler
        assert isinstance(chunker, _ChunkingBatchSampler)
        self._saved = chunker.physical_batch_size
        chunker.physical_batch_size = self.max_physical_batch_size
        self.data_loader.physical_batch_size = self.max_physical_batch_size
        return self.data_loader

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        chunker = self.data_loader.batch_sampler
        assert isinstance(chunker, _ChunkingBatchSampler)
        chunker.physical_batch_size = self._saved
        self.data_loader.physical_batch_size = self._saved
