"""The engine's randomness: secure (the OS CSPRNG, the default) or seeded research mode.

Resolved and checked before anything is built (:func:`resolve_randomness`): a conflicting pair of
flags, or a seed for a secure engine, is refused. A seed that silently stopped seeding the noise would
mislead a researcher; a seed that silently seeded it would make a "private" run replayable by whoever
reads the seed. In research mode the noise and the sampler get independent child seeds
(:func:`child_seeds`).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from veil.errors import InvalidParameterError

__all__ = ["Randomness", "child_seeds", "resolve_randomness"]

Randomness = Literal["secure", "seeded"]


def child_seeds(seed: int | None) -> tuple[int | None, int | None]:
    """The noise's and the sampler's seeds, spawned from ``seed`` (both None without one)."""
    if seed is None:
        return None, None
    noise, sampler = np.random.SeedSequence(seed).spawn(2)
    return int(noise.generate_state(1)[0]), int(sampler.generate_state(1)[0])


def resolve_randomness(secure_rng: Any, seed: Any, reproducible: Any) -> Randomness:
    """``"secure"`` unless research mode is asked for (``reproducible=True`` or ``secure_rng=False``).

    Checked before anything is built (see the module docstring).
    """
    if not isinstance(reproducible, bool):
        raise InvalidParameterError(
            "reproducible", reproducible, "the randomness mode must be explicit", "pass True or False"
        )
    if secure_rng is not None and not isinstance(secure_rng, bool):
        raise InvalidParameterError(
            "secure_rng", secure_rng, "the randomness mode must be explicit", "pass True, False or None"
        )
    if secure_rng is True and reproducible:
        raise InvalidParameterError(
            "secure_rng",
            secure_rng,
            "reproducible=True asks for seeded noise, which secure_rng=True forbids",
            "pass one of them: reproducible=True (research) or neither (secure, the default)",
        )
    seeded = reproducible or secure_rng is False
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidParameterError("seed", seed, "a seed must be a non-negative integer", "pass e.g. seed=0")
    if seed is not None and not seeded:
        raise InvalidParameterError(
            "seed",
            seed,
            "noise and Poisson sampling come from the OS CSPRNG by default; a seeded generator is "
            "predictable, so noise from it protects nothing against anyone who knows the seed",
            "drop the seed for a private run, or pass reproducible=True together with the seed for a "
            "seeded research run (not private against anyone who knows the seed)",
        )
    return "seeded" if seeded else "secure"
