"""The membership-inference attacks of an audit (loss threshold, LiRA with shadow models trained
through :mod:`veil.audit.fit`), their report section and plots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.audit.fit import Setup, fit
from veil.audit.settings import AuditSettings
from veil.pipeline.seeds import Purpose, derive_seed

if TYPE_CHECKING:
    from torch import nn

    from veil.audit.mia import MIAResult
    from veil.mechanisms.rng import RandomSource

__all__ = ["membership_attacks", "mia_section", "plots"]


def membership_attacks(
    setup: Setup,
    target: nn.Module,
    members: tuple[np.ndarray, np.ndarray],
    nonmembers: tuple[np.ndarray, np.ndarray],
    settings: AuditSettings,
    sigma: float,
    rng: RandomSource,
) -> tuple[list[MIAResult], float]:
    """The loss attack, and LiRA if the settings ask for it; (results, shadow training seconds)."""
    from veil.audit.mia import loss_attack

    attacks = [loss_attack(target, members, nonmembers, device=setup.cfg.device)]
    if not settings.uses_lira:
        return attacks, 0.0
    result, seconds = _lira(setup, target, members, nonmembers, settings, sigma, rng)
    return [*attacks, result], seconds


def _lira(
    setup: Setup,
    target: nn.Module,
    members: tuple[np.ndarray, np.ndarray],
    nonmembers: tuple[np.ndarray, np.ndarray],
    settings: AuditSettings,
    sigma: float,
    rng: RandomSource,
) -> tuple[MIAResult, float]:
    from veil.audit.mia import run_lira

    x = np.concatenate([members[0], nonmembers[0]])
    y = np.concatenate([members[1], nonmembers[1]])
    is_member = np.concatenate([np.ones(len(members[1]), bool), np.zeros(len(nonmembers[1]), bool)])
    seconds = 0.0

    def train_shadow(indices: np.ndarray, k: int) -> nn.Module:
        nonlocal seconds
        shadow = fit(
            setup,
            x[indices],
            y[indices],
            np.ones(len(indices), np.float32),
            sigma=sigma,
            seed=derive_seed(setup.cfg.seed, Purpose.SHADOW, k),
        )
        seconds += shadow.seconds
        return shadow.model

    result = run_lira(
        target,
        (x, y),
        is_member,
        train_shadow,
        shadows=settings.shadow_models,
        rng=rng,
        variant=settings.lira_variant,
        device=setup.cfg.device,
    )
    return result, seconds


def plots(
    attacks: list[MIAResult], groups: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, tuple[str, bytes]]:
    from veil.audit.report import canary_png, roc_png

    images: dict[str, tuple[str, bytes]] = {}
    if groups:
        images["canaries.png"] = ("Canary scores, included against excluded", canary_png(groups))
    if attacks:
        images["roc.png"] = ("Membership inference ROC", roc_png(attacks))
    return images


def mia_section(attacks: list[MIAResult]) -> dict[str, Any] | None:
    if not attacks:
        return None
    strongest = next((a for a in attacks if a.attack == "lira"), attacks[0])
    section = strongest.to_dict()
    section["attacks"] = {a.attack: a.to_dict() for a in attacks}
    return section
