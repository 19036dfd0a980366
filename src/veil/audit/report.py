"""The audit's plain-words reading, its plots (matplotlib Agg PNG) and ``report.html`` (one page)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from veil.audit.mia import MIAResult

__all__ = ["canary_png", "reading", "render_html", "roc_png", "verdict"]

Verdict = Literal["violation", "consistent", "no_promise", "not_audited"]


def verdict(epsilon_lower_bound: float | None, epsilon_theoretical: float | None) -> Verdict:
    """``violation`` when the measured bound exceeds the promise; the other cases by name."""
    if epsilon_lower_bound is None:
        return "not_audited"
    if epsilon_theoretical is None or not math.isfinite(epsilon_theoretical):
        return "no_promise"
    return "violation" if epsilon_lower_bound > epsilon_theoretical else "consistent"


def reading(
    epsilon_lower_bound: float | None,
    epsilon_theoretical: float | None,
    confidence: float,
    delta: float,
    mia: Mapping[str, Any] | None,
) -> str:
    """What the numbers mean, in plain words, for the report's reader."""
    v = verdict(epsilon_lower_bound, epsilon_theoretical)
    conf = f"{confidence:.0%}"
    parts: list[str] = []
    lb = epsilon_lower_bound
    if v == "violation":
        assert lb is not None and epsilon_theoretical is not None
        parts.append(
            f"ALERT: the audit measured ε ≥ {lb:.3g} with {conf} confidence, above the promised "
            f"ε = {epsilon_theoretical:.3g} (δ = {delta:g}). The training does not deliver its promise: "
            "the noise, the clipping, the sampling or the accounting is wrong. Do not release this model."
        )
    elif v == "consistent":
        assert lb is not None and epsilon_theoretical is not None
        if lb > 0:
            parts.append(
                f"With {conf} confidence this run leaks at least ε ≥ {lb:.3g}; the accountant promises "
                f"at most ε = {epsilon_theoretical:.3g} (δ = {delta:g}). The measurement is consistent "
                "with the promise."
            )
        else:
            parts.append(
                f"The canaries found no leakage that is significant at {conf} confidence; the accountant "
                f"promises at most ε = {epsilon_theoretical:.3g} (δ = {delta:g}). Consistent with the "
                "promise."
            )
        parts.append(
            "A lower bound below the promise does not show that the promise is loose: a stronger "
            "attack, or more canaries, may come closer."
        )
    elif v == "no_promise":
        assert lb is not None
        if lb > 0:
            parts.append(
                f"This run adds no noise and promises nothing (ε = ∞). The audit proves, with {conf} "
                f"confidence, that it leaks at least ε ≥ {lb:.3g}: someone holding the model can tell "
                f"whether a given record was trained on with odds up to e^{lb:.3g} ≈ {math.exp(lb):.3g} "
                "to 1."
            )
        else:
            parts.append(
                "This run adds no noise and promises nothing (ε = ∞); the canaries found no leakage "
                f"significant at {conf} confidence, which does not make it private."
            )
    else:
        parts.append(
            "No canary audit was run, so there is no ε lower bound: membership attacks are evidence, "
            "not a bound."
        )
    if mia:
        auc = float(mia["auc"])
        parts.append(
            f"The {mia['attack']} membership-inference attack reaches AUC {auc:.3f} (0.5 is guessing) and "
            f"recognises {float(mia['tpr_at_1pct_fpr']):.1%} of the training examples at a 1% "
            "false-positive rate."
        )
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def roc_png(results: Sequence[MIAResult]) -> bytes:
    """ROC curves of the attacks, linear and log-log (low-FPR regime) side by side."""
    from veil.report.plots import figure, png_bytes

    plt, fig = figure(9.0, 3.8)
    for i, log in enumerate((False, True)):
        ax = fig.add_subplot(1, 2, i + 1)
        for r in results:
            fpr = [max(v, 1e-5) for v in r.fpr] if log else r.fpr
            tpr = [max(v, 1e-5) for v in r.tpr] if log else r.tpr
            label = f"{r.attack}{' (' + r.variant + ')' if r.variant else ''}, AUC {r.auc:.3f}"
            ax.plot(fpr, tpr, label=label)
        ax.plot([1e-5, 1], [1e-5, 1], linestyle="--", color="gray", label="guessing")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(1e-3 if all(r.nonmembers >= 1000 for r in results) else 1e-2, 1)
            ax.set_ylim(1e-3, 1)
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Membership inference: ROC")
    return png_bytes(plt, fig)


def canary_png(groups: Mapping[str, tuple[Any, Any]]) -> bytes:
    """Histograms of canary scores, included against excluded, one panel per canary kind."""
    import numpy as np

    from veil.report.plots import figure, png_bytes

    plt, fig = figure(4.5 * max(1, len(groups)), 3.4)
    for i, (name, (scores, included)) in enumerate(groups.items()):
        ax = fig.add_subplot(1, max(1, len(groups)), i + 1)
        s = np.asarray(scores, dtype=float)
        inc = np.asarray(included, dtype=bool)
        finite = s[np.isfinite(s)]
        bins = np.linspace(finite.min(), finite.max(), 40) if finite.size and np.ptp(finite) > 0 else 10
        ax.hist(s[inc & np.isfinite(s)], bins=bins, alpha=0.6, label="included")
        ax.hist(s[~inc & np.isfinite(s)], bins=bins, alpha=0.6, label="excluded")
        ax.set_title(f"{name} canaries")
        ax.set_xlabel("score")
        ax.legend()
    return png_bytes(plt, fig)


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------
def render_html(report: Mapping[str, Any], images: Mapping[str, bytes]) -> str:
    """``report.html`` from the ``report.json`` dict (``templates/audit.html.j2``); ``images`` maps a
    title to PNG bytes."""
    from veil.report import Check
    from veil.report.render import render_page

    report = {**report, **(report.get("non_private") or {})}  # the measured figures are non-private
    theo = report.get("epsilon_theoretical")
    lb = report.get("epsilon_lower_bound")
    mia = report.get("mia") or {}
    checks = [
        Check(
            name="measured_within_promise",
            passed=report.get("verdict") != "violation",
            detail=f"verdict: {str(report.get('verdict', '')).replace('_', ' ')} (the measured lower bound "
            "must not exceed the accountant's ε)",
        )
    ]
    return render_page(
        "audit.html.j2",
        images,
        r=report,
        promised="∞ (no noise)" if theo is None else f"{theo:.4g}",
        measured="not audited" if lb is None else f"{lb:.4f}",
        canaries={k: v for k, v in (report.get("canaries") or {}).items() if isinstance(v, dict)},
        attacks=list((mia.get("attacks") or {}).values()),
        run=report.get("run") or {},
        source=report.get("source", ""),
        checks=checks,
        files=report.get("files") or {},
        summary=report.get("summary", ""),
        dataset_budget=report.get("dataset_budget"),
    )
