"""Where a job's private randomness comes from, decided once for every job (train, audit, PATE).

Guarantee. In the default **secure** mode every draw that the privacy guarantee rests on (DP-SGD
noise and Poisson sampling, a DP preprocessing release, PATE's vote noise, canary placement) comes
from the operating system's CSPRNG (:class:`~veil.mechanisms.rng.SecureSource`): no seed is derived
for it, no generator state is saved with a checkpoint, and a resumed run draws fresh noise. The
run's ``seed`` then drives data-independent choices only (the split key, the initialisation, random
features, the non-private baseline's shuffling, the synthetic inputs of the clipping check).

**Seeded** (research) mode, asked for explicitly (``--reproducible``, ``reproducible = true``):
the same draws come from generators seeded by ``derive_seed(seed, purpose, index)``, so a run can
be replayed exactly; it is **not** private against anyone who knows the seed. Such a run is never
release-ready: :func:`randomness_check` fails and the report and the CLI say so.

PATE and any other job: take its private sources from :func:`private_source`, put
:func:`randomness_check` in its checklist and :func:`release_ready` in its report.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from veil.pipeline.seeds import Purpose, derive_seed
from veil.report import Check

if TYPE_CHECKING:
    from veil.mechanisms.rng import RandomSource

__all__ = [
    "RESEARCH_CAVEAT",
    "Randomness",
    "private_source",
    "randomness_check",
    "randomness_of",
    "release_ready",
]

Randomness = Literal["secure", "seeded"]

RESEARCH_CAVEAT = (
    "research mode (--reproducible): noise and sampling came from generators seeded by the run's seed, "
    "so the result is not private against anyone who knows the seed"
)


def randomness_of(reproducible: bool) -> Randomness:
    """``"seeded"`` in research mode, else ``"secure"``."""
    return "seeded" if reproducible else "secure"


def private_source(reproducible: bool, seed: int, purpose: Purpose, index: int = 0) -> RandomSource:
    """The source of a private draw: the OS CSPRNG, or in research mode the seed derived for
    ``(seed, purpose, index)`` (no seed is derived at all in secure mode)."""
    from veil.mechanisms.rng import SecureSource, SeededSource

    if not reproducible:
        return SecureSource()
    return SeededSource(derive_seed(seed, purpose, index))


def randomness_check(randomness: str) -> Check:
    """Passes only for secure randomness: a seeded run's noise can be recomputed from its seed."""
    secure = randomness == "secure"
    return Check(
        name="secure_randomness",
        passed=secure,
        detail=(
            "noise and Poisson sampling drawn from the OS CSPRNG; no seed or generator state of them "
            "is stored in the run folder, and a resume draws fresh noise"
            if secure
            else RESEARCH_CAVEAT + "; run without --reproducible for a release"
        ),
    )


def release_ready(randomness: str, checks: Iterable[Check]) -> bool:
    """A result may be released under its stated guarantee: secure randomness and every check passed."""
    return randomness == "secure" and all(c.passed for c in checks)
