"""What the engine trains with across ranks: the per-rank pieces of data-parallel DP-SGD.

:mod:`~veil.data_parallel.setup` (the checks ``make_private`` runs across ranks and the
:class:`~veil.data_parallel.setup.DistributedSetup` it builds from a ``DistributedDataParallel`` module
or ``distributed=True``), :mod:`~veil.data_parallel.sampler` (each rank's shard of one Poisson sample
of the whole dataset) and :mod:`~veil.data_parallel.optimizer` (one all-reduce of the clipped sums per
logical step, the noise added once). The guarantee is the one-process guarantee of the same plan; it is
stated in :mod:`veil.distributed`, whose public names these are, beside the launcher and the rank-side
train job (a layer above: they start processes and run jobs; the engine imports only this package).
"""
