"""Seeds for the parts of a run: one derivation from the user's seed, one purpose per consumer.

In research mode (``reproducible = true``) every random part of a job (initialisation, preprocessing
noise, DP-SGD noise and sampling, the baseline's shuffling, canaries, shadow models, PATE's splits)
draws from its own seed, derived from the run's seed and the part's :class:`Purpose` by
:func:`derive_seed`: distinct purposes (and distinct indices of one purpose) give independent
streams, and the same (seed, purpose, index) always gives the same stream. In secure mode the
noise never comes from a derived seed (see :mod:`veil.mechanisms.rng`); a derived seed then only
drives public choices (initialisation, splits of public data).
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["Purpose", "derive_seed"]


class Purpose(enum.IntEnum):
    """What a derived seed is for. Values are part of the reproducibility contract: never reuse one."""

    PREPROCESSING = 1
    """A DP preprocessing release (index: which release of the run, from 1)."""
    ENGINE = 2
    """The privacy engine's noise and Poisson sampling."""
    BASELINE = 3
    """The non-private baseline's shuffled batches."""
    CLIP_CHECK = 7
    """The synthetic inputs of the report's per-sample clipping check."""
    MIXING_PROBE = 8
    """The synthetic inputs of the example-mixing probe (:mod:`veil.pipeline.public_inputs`)."""
    AUDIT = 11
    """Canary design and LiRA's shadow splits."""
    AUGMENT = 12
    """``--augment K``: the random shifts and flips of each example's copies."""
    PATE_HOLDOUT = 20
    PATE_QUERIES = 21
    PATE_STUDENT = 22
    PATE_NOISE = 23
    FEDERATED_SAMPLING = 30
    """Client-level DP-FedAvg's Poisson sampling of clients."""
    FEDERATED_NOISE = 31
    """Client-level DP-FedAvg's noise on the sum of clipped updates."""
    FEDERATED_LOCAL = 32
    """A client's local training in one round (index: round × 1_000_003 + client + 1)."""
    SHADOW = 1000
    """A LiRA shadow model (index: which shadow)."""


def derive_seed(seed: int, purpose: Purpose, index: int = 0) -> int:
    """The seed of ``purpose`` (its ``index``-th use) in a run seeded with ``seed``: a 32-bit value
    from :class:`numpy.random.SeedSequence` over ``(seed, purpose)`` or ``(seed, purpose, index)``."""
    entropy = [int(seed), int(purpose)] if index == 0 else [int(seed), int(purpose), int(index)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])
