"""The audit's plain-words reading, its plots (matplotlib Agg PNG) and ``report.html`` (one page)."""

from __future__ import annotations

import base64
import io
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
def _figure(width: float, height: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(width, height), dpi=100)


def _png(plt: Any, fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def roc_png(results: Sequence[MIAResult]) -> bytes:
    """ROC curves of the attacks, linear and log-log (low-FPR regime) side by side."""
    plt, fig = _figure(9.0, 3.8)
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
    return _png(plt, fig)


def canary_png(groups: Mapping[str, tuple[Any, Any]]) -> bytes:
    """Histograms of canary scores, included against excluded, one panel per canary kind."""
    import numpy as np

    plt, fig = _figure(4.5 * max(1, len(groups)), 3.4)
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
    return _png(plt, fig)


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------
_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>veil audit</title>
<style>
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:1rem 0}
td,th{border:1px solid #ccc;padding:.3rem .6rem;text-align:left}
.big{font-size:1.4rem}.violation{color:#b00020;font-weight:bold}.consistent{color:#1b5e20}
.reading{background:#f5f5f5;padding:1rem;border-left:4px solid #888}
</style></head><body>
<h1>Privacy audit</h1>
<p>{{ source }}</p>
<table class="big">
<tr><th>promised ε (δ = {{ '%g' % r.delta }})</th>
<th>measured ε lower bound ({{ '%.0f' % (100 * r.confidence) }}% confidence)</th><th>verdict</th></tr>
<tr><td>{{ promised }}</td><td>{{ measured }}</td>
<td class="{{ r.verdict }}">{{ r.verdict.replace('_', ' ') }}</td></tr>
</table>
<p class="reading">{{ r.reading }}</p>
{% if canaries %}
<h2>Canary audits (one run)</h2>
<table><tr><th>kind</th><th>canaries</th><th>included</th><th>score</th><th>guesses</th>
<th>correct</th><th>ε lower bound</th><th>confidence</th></tr>
{% for name, c in canaries.items() %}
<tr><td>{{ name }}{% if c.get('direction') %} ({{ c.direction }}){% endif %}</td>
<td>{{ c.count }}</td><td>{{ c.included }}</td><td>{{ c.score }}</td>
<td>{{ c.bound.guesses }} ({{ c.bound.guessed_in }} in, {{ c.bound.guessed_out }} out)</td>
<td>{{ c.bound.correct }}</td><td>{{ '%.4f' % c.bound.epsilon }}</td>
<td>{{ '%.4g' % c.bound.confidence }}</td></tr>
{% endfor %}</table>
<p>Each canary was included with probability ½. The bound is the largest ε such that, were the run
(ε, δ)-DP, this many correct guesses would have probability at most 1 − confidence (Steinke, Nasr &amp;
Jagielski 2023). Several guess counts were tried and paid for with a Bonferroni correction.</p>
{% endif %}
{% if attacks %}
<h2>Membership inference</h2>
<table><tr><th>attack</th><th>AUC</th><th>TPR at 0.1% FPR</th><th>TPR at 1% FPR</th>
<th>members</th><th>non-members</th></tr>
{% for a in attacks %}
<tr><td>{{ a.attack }}{% if a.get('variant') %}
({{ a.variant }}, {{ a.shadow_models }} shadows){% endif %}</td>
<td>{{ '%.4f' % a.auc }}</td><td>{{ '%.4f' % a['tpr_at_0.1pct_fpr'] }}</td>
<td>{{ '%.4f' % a['tpr_at_1pct_fpr'] }}</td><td>{{ a.members }}</td><td>{{ a.nonmembers }}</td></tr>
{% endfor %}</table>
<p>With n non-members the smallest non-zero false-positive rate is 1/n.</p>
{% endif %}
{% for title, data in images.items() %}<h3>{{ title }}</h3>
<img alt="{{ title }}" src="data:image/png;base64,{{ data }}" style="max-width:100%">{% endfor %}
<h2>Run</h2>
<table>{% for k, v in run.items() %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table>
<p>The audit's own numbers are diagnostics about the training data and are not covered by any privacy
guarantee: keep this report internal.</p>
</body></html>
"""


def render_html(report: Mapping[str, Any], images: Mapping[str, bytes]) -> str:
    """``report.html`` from the ``report.json`` dict; ``images`` maps a title to PNG bytes."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(_TEMPLATE)
    theo = report.get("epsilon_theoretical")
    lb = report.get("epsilon_lower_bound")
    mia = report.get("mia") or {}
    source = report.get("source", "")
    return template.render(
        r=report,
        promised="∞ (no noise)" if theo is None else f"{theo:.4g}",
        measured="not audited" if lb is None else f"{lb:.4f}",
        canaries={k: v for k, v in (report.get("canaries") or {}).items() if isinstance(v, dict)},
        attacks=list((mia.get("attacks") or {}).values()),
        images={t: base64.b64encode(png).decode("ascii") for t, png in images.items()},
        run=report.get("run") or {},
        source=source,
    )
