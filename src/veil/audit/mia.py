"""Membership-inference attacks on a trained classifier: loss threshold and LiRA.

Both attacks give every candidate example a score (higher = "more likely a training member") and are
judged by their ROC curve over known members (the training split) and non-members (held out):

* **loss threshold** (Yeom et al. 2018): score = −cross-entropy of the example under the model.
  Needs only the model.
* **LiRA** (Carlini et al. 2022, "Membership inference attacks from first principles"): the
  logit-scaled confidence φ(x, y) = log p_y − log(1 − p_y) of the target model is compared with its
  distribution over *shadow models* trained by the same pipeline on random halves of a data pool.
  *Online*: Gaussians fitted to φ under the shadows that trained on the example (IN) and those that
  did not (OUT); score = log N(φ; μ_in, σ_in²) − log N(φ; μ_out, σ_out²). *Offline* (OUT shadows only,
  better with few shadows): score = log Φ((φ − μ_out) / σ_out), a one-sided test. With few shadows
  the variances are pooled over all examples ("fixed variance"), as the paper recommends.

An attack is empirical evidence, not a privacy bound: the ROC numbers say how well *this* attack
did on *this* model. The ε lower bounds with a stated confidence come from canaries
(:mod:`veil.audit.canaries`, :mod:`veil.audit.bounds`). AUC and TPR at low FPR are computed with
scikit-learn; TPR at FPR ``f`` is the best TPR over thresholds whose FPR is at most ``f`` (with ``n``
non-members the smallest non-zero FPR is ``1/n``, so "TPR at 0.1% FPR" on 360 non-members is the TPR
at zero false positives).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from veil.errors import InvalidParameterError

if TYPE_CHECKING:
    from torch import nn

    from veil.mechanisms.rng import RandomSource

__all__ = [
    "MIAResult",
    "lira_scores",
    "logit_confidence",
    "loss_attack",
    "model_logits",
    "per_example_loss",
    "roc_result",
    "run_lira",
    "shadow_membership",
]

LiraVariant = Literal["online", "offline"]
_ROC_POINTS = 400
_MIN_STD = 1e-6


@dataclass(frozen=True)
class MIAResult:
    """ROC summary of one membership-inference attack."""

    attack: str
    auc: float
    tpr_at_0_1pct_fpr: float
    tpr_at_1pct_fpr: float
    members: int
    nonmembers: int
    variant: str | None = None
    shadow_models: int | None = None
    fpr: list[float] = field(default_factory=list, repr=False)
    tpr: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The ``report.json`` form (stable keys; the curve itself is in the plot)."""
        out: dict[str, Any] = {
            "attack": self.attack,
            "auc": self.auc,
            "tpr_at_0.1pct_fpr": self.tpr_at_0_1pct_fpr,
            "tpr_at_1pct_fpr": self.tpr_at_1pct_fpr,
            "members": self.members,
            "nonmembers": self.nonmembers,
        }
        if self.variant is not None:
            out["variant"] = self.variant
            out["shadow_models"] = self.shadow_models
        return out


def _tpr_at(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    ok = fpr <= target + 1e-12
    return float(tpr[ok].max()) if ok.any() else 0.0


def roc_result(
    member_scores: Sequence[float] | np.ndarray,
    nonmember_scores: Sequence[float] | np.ndarray,
    attack: str,
    *,
    variant: str | None = None,
    shadow_models: int | None = None,
) -> MIAResult:
    """AUC, TPR at 0.1% and 1% FPR and a down-sampled ROC curve from the two score samples."""
    from sklearn.metrics import roc_auc_score, roc_curve

    pos = np.asarray(member_scores, dtype=np.float64).ravel()
    neg = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    if pos.size == 0 or neg.size == 0:
        raise InvalidParameterError(
            "membership",
            f"{pos.size} members, {neg.size} non-members",
            "an ROC curve needs examples on both sides",
            "pass a non-empty training split and held-out set",
        )
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise InvalidParameterError(
            "scores", "non-finite", "every example needs a finite attack score", "check the model outputs"
        )
    labels = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])
    scores = np.concatenate([pos, neg])
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    keep = np.unique(np.linspace(0, fpr.size - 1, num=min(fpr.size, _ROC_POINTS)).round().astype(int))
    return MIAResult(
        attack=attack,
        auc=float(roc_auc_score(labels, scores)),
        tpr_at_0_1pct_fpr=_tpr_at(fpr, tpr, 1e-3),
        tpr_at_1pct_fpr=_tpr_at(fpr, tpr, 1e-2),
        members=int(pos.size),
        nonmembers=int(neg.size),
        variant=variant,
        shadow_models=shadow_models,
        fpr=[float(v) for v in fpr[keep]],
        tpr=[float(v) for v in tpr[keep]],
    )


# ---------------------------------------------------------------------------------------------
# Model outputs
# ---------------------------------------------------------------------------------------------
def model_logits(model: nn.Module, x: np.ndarray, *, device: str = "cpu", batch: int = 2048) -> np.ndarray:
    """The model's logits on ``x`` as float64 ``[n, classes]`` (eval mode, no gradients)."""
    import torch

    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch):
                xb = torch.as_tensor(x[i : i + batch], device=device)
                out.append(model(xb).detach().to("cpu", torch.float64).numpy())
    finally:
        model.train(was_training)
    if not out:
        return np.zeros((0, 0))
    return np.concatenate(out, axis=0)


def _check_labels(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    y = np.asarray(y).astype(np.int64).ravel()
    if logits.ndim != 2 or logits.shape[0] != y.size:
        raise InvalidParameterError(
            "logits", logits.shape, f"expected one row of class scores per label ({y.size})", "check shapes"
        )
    return y


def per_example_loss(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cross-entropy of each example: ``logsumexp(z) − z_y``."""
    from scipy.special import logsumexp

    y = _check_labels(logits, y)
    return np.asarray(logsumexp(logits, axis=1) - logits[np.arange(y.size), y])


def logit_confidence(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """φ = log p_y − log(1 − p_y) = z_y − logsumexp_{j≠y} z_j, computed stably (LiRA's statistic)."""
    from scipy.special import logsumexp

    y = _check_labels(logits, y)
    rows = np.arange(y.size)
    others = logits.copy()
    others[rows, y] = -np.inf
    return np.asarray(logits[rows, y] - logsumexp(others, axis=1))


# ---------------------------------------------------------------------------------------------
# Loss threshold
# ---------------------------------------------------------------------------------------------
def loss_attack(
    model: nn.Module,
    members: tuple[np.ndarray, np.ndarray],
    nonmembers: tuple[np.ndarray, np.ndarray],
    *,
    device: str = "cpu",
) -> MIAResult:
    """The loss-threshold attack: members are guessed where the loss is low (score = −loss)."""
    (x_in, y_in), (x_out, y_out) = members, nonmembers
    s_in = -per_example_loss(model_logits(model, x_in, device=device), y_in)
    s_out = -per_example_loss(model_logits(model, x_out, device=device), y_out)
    return roc_result(s_in, s_out, "loss")


# ---------------------------------------------------------------------------------------------
# LiRA
# ---------------------------------------------------------------------------------------------
def shadow_membership(n: int, shadows: int, rng: RandomSource) -> np.ndarray:
    """``[shadows, n]`` bool: every example is IN exactly ⌊shadows/2⌋ shadow training sets, at random."""
    if isinstance(shadows, bool) or not isinstance(shadows, int) or shadows < 2:
        raise InvalidParameterError(
            "shadow_models",
            shadows,
            "LiRA compares the target with shadow models that did and did not train on each example; "
            "each example must be OUT of at least one",
            "pass at least 2 shadow models (16 or more for the online variant)",
        )
    keys = rng.uniform((shadows, n))
    rank = np.argsort(np.argsort(keys, axis=0), axis=0)
    return np.asarray(rank < shadows // 2)


def _pooled_std(phi: np.ndarray, mask: np.ndarray, mean: np.ndarray) -> float:
    resid = np.where(mask, phi - mean[None, :], 0.0)
    count = int(mask.sum())
    if count < 2:
        return 1.0
    return max(float(math.sqrt((resid**2).sum() / (count - 1))), _MIN_STD)


def _side(phi: np.ndarray, mask: np.ndarray, fixed_variance: bool) -> tuple[np.ndarray, np.ndarray]:
    counts = mask.sum(axis=0)
    if (counts == 0).any():
        raise InvalidParameterError(
            "shadow_models",
            int(mask.shape[0]),
            "some example has no shadow model on this side (IN or OUT), so its distribution is unknown",
            "use shadow_membership() to assign shadow training sets, with at least 2 shadows",
        )
    mean = np.where(mask, phi, 0.0).sum(axis=0) / counts
    if fixed_variance:
        return mean, np.full(mean.shape, _pooled_std(phi, mask, mean))
    resid2 = np.where(mask, (phi - mean[None, :]) ** 2, 0.0).sum(axis=0)
    std = np.sqrt(resid2 / np.maximum(counts - 1, 1))
    pooled = _pooled_std(phi, mask, mean)
    std = np.where(counts >= 2, np.maximum(std, _MIN_STD), pooled)
    return mean, std


def lira_scores(
    target_phi: np.ndarray,
    shadow_phi: np.ndarray,
    shadow_in: np.ndarray,
    *,
    variant: LiraVariant = "online",
    fixed_variance: bool = True,
) -> np.ndarray:
    """LiRA membership scores (higher = member) for each example (see the module docstring).

    ``target_phi [n]``: φ under the target model; ``shadow_phi [K, n]``: φ under each shadow;
    ``shadow_in [K, n]``: whether shadow k trained on example i.
    """
    from scipy.stats import norm

    t = np.asarray(target_phi, dtype=np.float64).ravel()
    phi = np.asarray(shadow_phi, dtype=np.float64)
    inside = np.asarray(shadow_in, dtype=bool)
    if phi.ndim != 2 or phi.shape != inside.shape or phi.shape[1] != t.size:
        raise InvalidParameterError(
            "shadow_phi",
            phi.shape,
            f"expected [shadows, {t.size}] statistics and a membership mask of the same shape",
            "pass one row per shadow model",
        )
    if variant not in ("online", "offline"):
        raise InvalidParameterError("variant", variant, "unknown LiRA variant", "use 'online' or 'offline'")
    mu_out, sd_out = _side(phi, ~inside, fixed_variance)
    if variant == "offline":
        return np.asarray(norm.logcdf((t - mu_out) / sd_out))
    mu_in, sd_in = _side(phi, inside, fixed_variance)
    return np.asarray(norm.logpdf(t, mu_in, sd_in) - norm.logpdf(t, mu_out, sd_out))


def run_lira(
    target: nn.Module,
    pool: tuple[np.ndarray, np.ndarray],
    is_member: np.ndarray,
    train_shadow: Callable[[np.ndarray, int], nn.Module],
    *,
    shadows: int,
    rng: RandomSource,
    variant: LiraVariant | Literal["auto"] = "auto",
    device: str = "cpu",
) -> MIAResult:
    """LiRA against ``target`` over ``pool = (x, y)``, whose members are marked by ``is_member``.

    ``train_shadow(indices, k)`` trains shadow ``k`` on ``pool[indices]`` with the target's own
    pipeline. Every pool example is IN half of the shadows. ``variant="auto"`` is online from 16
    shadows on, offline below; variances are pooled below 64 shadows.
    """
    x, y = pool
    member = np.asarray(is_member, dtype=bool).ravel()
    if member.size != len(y):
        raise InvalidParameterError(
            "is_member", member.size, f"one flag per pool example ({len(y)})", "pass a flag per example"
        )
    chosen: LiraVariant = ("online" if shadows >= 16 else "offline") if variant == "auto" else variant
    inside = shadow_membership(len(y), shadows, rng)
    phis = []
    for k in range(shadows):
        model = train_shadow(np.flatnonzero(inside[k]), k)
        phis.append(logit_confidence(model_logits(model, x, device=device), y))
    t = logit_confidence(model_logits(target, x, device=device), y)
    scores = lira_scores(t, np.stack(phis), inside, variant=chosen, fixed_variance=shadows < 64)
    return roc_result(scores[member], scores[~member], "lira", variant=chosen, shadow_models=shadows)
