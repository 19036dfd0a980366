"""Opacus's ``PrivacyEngine`` arguments, mapped onto veil's (or refused with the Opacus habit named).

Pure argument checking: nothing here builds an engine, a model or an accountant, and nothing here
imports torch. :class:`veil.PrivacyEngine` calls these functions before it changes any state, so a
refusal leaves everything untouched. See ``docs/migrating-from-opacus.md`` for the table.
"""

from __future__ import annotations

import math
from typing import Any

from veil.errors import InvalidParameterError

__all__ = [
    "GRAD_SAMPLE_MODES",
    "check_delta_for_dataset",
    "check_make_private_args",
    "check_noise_generator",
    "resolve_accountant",
    "resolve_secure_mode",
    "returns_criterion",
]

# Opacus's ways of computing per-sample gradients. veil computes exact per-sample gradients in the
# ordinary backward pass (ghost norms or materialised, chosen by cost) whichever one is named.
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")


def resolve_accountant(name: Any) -> Any:
    """veil's accountant for an Opacus accountant name: ``prv`` → ``pld``; ``gdp`` is refused.

    ``prv`` (Opacus's default) and veil's ``pld`` compute the same object, the privacy loss
    distribution, numerically; veil's rounding is pessimistic. ``gdp`` (Opacus's
    ``GaussianAccountant``) uses a central-limit approximation that is not an upper bound and is
    known to report a smaller ε than the mechanism has for realistic q and step counts: refused.
    Other names pass through to veil's own check.
    """
    if name == "prv":
        return "pld"
    if name == "gdp":
        raise InvalidParameterError(
            "accountant",
            name,
            "Opacus's 'gdp' accountant approximates DP-SGD by a central limit theorem; the result is not an "
            "upper bound and under-reports ε for realistic sampling rates and step counts",
            "use accountant='prv' (veil's tight PLD accountant, the default) or 'rdp'",
        )
    return name


def resolve_secure_mode(secure_mode: Any, secure_rng: Any, seed: Any) -> Any:
    """The engine's ``secure_rng`` given Opacus's ``secure_mode``.

    * ``None`` (not given): ``secure_rng`` unchanged.
    * ``True``: noise and sampling from the OS CSPRNG (``secure_rng=True``); a seed is refused, as
      Opacus refuses one in secure mode.
    * ``False``: Opacus's "fast, non-cryptographic noise for experiments". veil draws its noise the same
      way whatever is asked here, so ``secure_rng`` is unchanged: veil never weakens the noise to
      match a speed setting. A reproducible (seeded) run is asked for with veil's own arguments.
    """
    if secure_mode is None:
        return secure_rng
    if not isinstance(secure_mode, bool):
        raise InvalidParameterError(
            "secure_mode", secure_mode, "the randomness mode must be explicit", "pass True or False"
        )
    if not secure_mode:
        return secure_rng
    if seed is not None:
        raise InvalidParameterError(
            "seed",
            seed,
            "secure_mode=True draws noise from the OS CSPRNG, which cannot be seeded (Opacus refuses a seed "
            "in secure mode too); a seed would promise a reproducibility the noise does not have",
            "drop the seed, or drop secure_mode=True for a reproducible research run",
        )
    return True


def check_noise_generator(noise_generator: Any, research_mode: bool) -> int | None:
    """The seed to draw noise from for Opacus's ``noise_generator=``, or None when it is not given.

    Opacus users seed the noise with ``noise_generator=torch.Generator().manual_seed(s)``. Whoever
    knows ``s`` can recompute that noise and subtract it, so veil accepts a seeded noise stream only
    in research mode (an engine whose noise is already seeded), and only a generator that has not been
    drawn from since it was seeded (its state is then that seed's, so the run is reproducible from
    ``s``). The returned seed replaces the engine's noise seed; sampling keeps its own stream.
    """
    if noise_generator is None:
        return None
    if not research_mode:
        raise InvalidParameterError(
            "noise_generator",
            type(noise_generator).__name__,
            "Opacus seeds DP-SGD noise with a torch.Generator; noise from a seeded generator is known to "
            "whoever knows the seed and protects nothing against them, and this engine draws its noise "
            "from the OS CSPRNG",
            "drop noise_generator for a private run; for a reproducible research run ask the engine for "
            "seeded randomness (PrivacyEngine(seed=..., reproducible=True)) and then pass it",
        )
    import torch

    if not isinstance(noise_generator, torch.Generator):
        raise InvalidParameterError(
            "noise_generator",
            type(noise_generator).__name__,
            "only a torch.Generator can be read as a seed",
            "pass torch.Generator().manual_seed(s), or leave it out",
        )
    seed = int(noise_generator.initial_seed())
    fresh = torch.Generator(device=noise_generator.device).manual_seed(seed)
    if not torch.equal(fresh.get_state(), noise_generator.get_state()):
        raise InvalidParameterError(
            "noise_generator",
            f"seeded with {seed}, then drawn from",
            "veil draws the noise itself from the generator's seed; a generator already drawn from is not "
            "at that seed's start, so the run would not be what the generator promises",
            "pass a freshly seeded torch.Generator().manual_seed(s)",
        )
    return seed


def check_make_private_args(
    *,
    batch_first: bool,
    grad_sample_mode: str | None,
    clipping: Any,
    max_grad_norm: Any,
    wrap_model: bool,
    rand_on_empty: bool,
) -> None:
    """Refuse the Opacus arguments veil cannot honour, each with the Opacus habit and the fix."""
    if batch_first is not True:
        raise InvalidParameterError(
            "batch_first",
            batch_first,
            "veil finds each example in dimension 0 of every layer's input; Opacus's batch_first=False "
            "(examples in dimension 1) would make it clip slices that are not examples",
            "keep batch_first=True and build recurrent/attention layers with batch_first=True (or "
            "transpose inside the model)",
        )
    if grad_sample_mode is not None and grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise InvalidParameterError(
            "grad_sample_mode",
            grad_sample_mode,
            "veil computes exact per-sample gradients in the ordinary backward pass and knows the Opacus "
            f"modes {list(GRAD_SAMPLE_MODES)}; other modes (no_op, ghost_fsdp, ...) hand clipping to code "
            "veil cannot check",
            "leave grad_sample_mode out (or use 'hooks' / 'ghost')",
        )
    if clipping == "adaptive":
        raise InvalidParameterError(
            "clipping",
            clipping,
            "Opacus's adaptive clipping estimates a quantile of the gradient norms from private data; veil "
            "has no accounted version of that estimate, and an unaccounted one leaks",
            "use clipping='flat' with a fixed max_grad_norm",
        )
    if isinstance(max_grad_norm, (list, tuple)):
        raise InvalidParameterError(
            "max_grad_norm",
            list(max_grad_norm),
            "Opacus takes one clip norm per parameter for clipping='per_layer'; veil's engine takes one "
            "total norm C (per-layer clipping splits it across layers)",
            f"pass max_grad_norm={math.sqrt(sum(float(c) ** 2 for c in max_grad_norm)):.4g} (the "
            "root-sum-square of the per-layer norms, the same total sensitivity)",
        )
    if wrap_model is not True and wrap_model is not False:
        raise InvalidParameterError("wrap_model", wrap_model, "it is a flag", "pass True or False")
    if rand_on_empty:
        raise InvalidParameterError(
            "rand_on_empty",
            rand_on_empty,
            "veil feeds an empty Poisson batch through the model as a batch of 0 examples; random "
            "stand-in data is not needed",
            "drop rand_on_empty",
        )


def returns_criterion(grad_sample_mode: str | None) -> bool:
    """Opacus returns ``(model, optimizer, criterion, loader)`` for ghost clipping, else 3 values."""
    return grad_sample_mode == "ghost"


def check_delta_for_dataset(delta: Any, dataset_size: int) -> None:
    """Refuse δ ≥ 1/N, naming the Opacus habit of a fixed δ = 1e-5 whatever the dataset size."""
    if (
        isinstance(delta, (int, float))
        and not isinstance(delta, bool)
        and math.isfinite(delta)
        and delta >= 1.0 / dataset_size
    ):
        raise InvalidParameterError(
            "delta",
            delta,
            f"δ ≥ 1/N (N = {dataset_size}) allows a mechanism that publishes one whole record outright; "
            "Opacus accepts any δ (its examples use 1e-5 whatever the dataset size)",
            f"pass δ well below 1/N, e.g. {10 ** math.floor(math.log10(1.0 / dataset_size) - 1):g}",
        )
