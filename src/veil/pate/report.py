"""The PATE run report: ``report.json`` (stable field names), ``report.html`` and two PNG plots.

Field names are part of veil's interface: new fields may be added, existing ones keep their name
and meaning. ``epsilon`` is always the ε of the stated guarantee (``guarantee``); both analyses are
reported next to it.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["PateReport", "epsilon_png", "guarantee_text", "margins_png", "render_html"]


class PateReport(BaseModel):
    """Everything to file about one ``veil pate`` run."""

    model_config = ConfigDict(extra="forbid")

    # The guarantee.
    epsilon: float
    guarantee: str
    guarantee_statement: str
    epsilon_data_independent: float
    epsilon_data_dependent: float | None
    delta: float
    target_epsilon: float
    budget: str
    neighbouring: str = "add_or_remove_one"
    privacy_unit: str
    accountant: str
    # The mechanism.
    aggregator: str
    noise: dict[str, float | None]
    data_dependent: dict[str, Any] | None
    events: dict[str, Any]
    teachers: int
    teacher_sizes: dict[str, float]
    queries_planned: int
    queries_asked: int
    queries_answered: int
    stop_reason: str
    # Utility (diagnostics computed without privacy).
    label_accuracy: float | None
    teacher_accuracy: float
    student_test_accuracy: float | None
    """None when no student was trained (a failed PTR test releases no label)."""
    student_train_size: int
    student_semi_supervised: bool = False
    """Whether the student was also self-trained on the unlabelled public pool (no privacy cost)."""
    student_pseudo_labels: int = 0
    ptr: dict[str, Any] | None = None
    """PTR budget: the public plan (ε/δ split, λ, B, τ), the selection size and the test outcome."""
    # Data and models.
    dataset: dict[str, Any]
    teacher_model: str
    student_model: str
    # Reproducibility and audit.
    seed: int
    secure_rng: bool
    teachers_resumed: int
    veil_version: str
    duration_s: float
    history: dict[str, list[list[float]]]
    vote_margins: dict[str, Any]
    files: dict[str, str]
    out_dir: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the content of ``report.json``)."""
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"


def _ptr_text(r: PateReport, unit: str, released: str) -> str:
    p = r.ptr or {}
    outcome = (
        f"the test passed and {r.queries_answered} labels were released"
        if p.get("passed")
        else "the test failed and no label was released (the ε is spent all the same)"
    )
    return (
        f"Guarantee (Propose-Test-Release): {released} and the pass/fail outcome of the test are "
        f"({r.epsilon:.4g}, {r.delta:g})-differentially private with respect to each {unit}, whatever the "
        f"data: ε = {p.get('eps_select', 0.0):.3g} (selection, data-independent) + "
        f"{p.get('eps_test', 0.0):.3g} (private test that the data is far from any dataset whose "
        f"data-dependent Rényi cost at order {p.get('order')} exceeds {p.get('bound', 0.0):.4g}) + "
        f"{p.get('eps_release', 0.0):.3g} (the labels, bounded by that cost). In this run {outcome}. "
        f"For comparison, the data-independent analysis of the same release gives "
        f"ε = {r.epsilon_data_independent:.4g}."
    )


def guarantee_text(r: PateReport) -> str:
    """The guarantee in plain words (also stored as ``guarantee_statement``)."""
    unit = "group (as given by the group ids)" if r.privacy_unit == "group" else "private training example"
    released = "the labels released for the student (hence the student model, by post-processing)"
    if r.guarantee == "ptr":
        return _ptr_text(r, unit, released)
    if r.epsilon_data_dependent is not None:
        released += " and the released data-dependent privacy cost"
    di = (
        f"Unconditional guarantee: {released} are ({r.epsilon_data_independent:.4g}, {r.delta:g})-"
        f"differentially private with respect to each {unit}: adding or removing one changes the "
        f"probability of any outcome by at most a factor e^{r.epsilon_data_independent:.4g}, except with "
        f"probability {r.delta:g}, whatever the data (data-independent analysis of the {r.aggregator} "
        "aggregator, every query asked and every release included)."
    )
    if r.epsilon_data_dependent is None:
        return di
    dd = r.data_dependent or {}
    conf = dd.get("confidence", 0.95)
    ddtext = (
        f" Data-dependent (per-instance) bound: with probability {conf:g} over the release noise, for this "
        f"particular private dataset and every dataset differing from it in one {unit}, the probability of "
        f"any outcome is at most e^{r.epsilon_data_dependent:.4g} times larger on this dataset than on the "
        f"other, plus {r.delta:g} (Papernot et al. 2018, Rényi order {dd.get('order')}, released through "
        "smooth sensitivity, the release itself paid for). It is not a guarantee for every dataset."
    )
    if r.budget == "data-dependent":
        return (
            f"The budget of this run was the data-dependent ε. {ddtext.strip()} The guarantee that holds "
            f"for every dataset is the data-independent ε = {r.epsilon_data_independent:.4g}: " + di
        )
    return di + ddtext


def _caveats(r: PateReport) -> list[str]:
    out = [
        "Label accuracy, teacher accuracy, the vote margins and the student's test accuracy are "
        "diagnostics computed on private data without privacy: keep this report internal; release the "
        "student model (and, if wanted, the ε values) only.",
        "Teachers are trained without privacy on disjoint partitions; their weights and votes (saved in "
        "the run folder) are as sensitive as the private data.",
    ]
    if not r.secure_rng:
        out.append(
            "Noise came from a seeded generator (research mode): whoever knows the seed can recompute "
            "it. Run with --secure-rng for labels that are to be released."
        )
    return out


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


def epsilon_png(
    curve: Sequence[Sequence[float]], released: Sequence[Sequence[float]], target: float, delta: float
) -> bytes:
    """ε against queries answered: the data-independent cost of the path, and released values."""
    plt, fig = _figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    if curve:
        ax.plot([c[0] for c in curve], [c[2] for c in curve], marker=".", label="data-independent (path)")
    if released:
        ax.plot(
            [c[0] for c in released],
            [c[2] for c in released],
            "s",
            color="tab:green",
            label="released data-dependent",
        )
    ax.axhline(target, linestyle="--", color="tab:red", label=f"target ε = {target:g}")
    ax.set_xlabel("queries answered")
    ax.set_ylabel(f"ε (δ = {delta:g})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Privacy spent while labelling")
    return _png(plt, fig)


def margins_png(margins: Sequence[int], answered: Sequence[bool], num_teachers: int) -> bytes:
    """Histogram of vote margins (top count − second count), answered vs not answered."""
    plt, fig = _figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    bins = min(50, num_teachers + 1)
    yes = [m for m, a in zip(margins, answered, strict=True) if a]
    no = [m for m, a in zip(margins, answered, strict=True) if not a]
    ax.hist([yes, no], bins=bins, range=(0, num_teachers), stacked=True, label=["answered", "not answered"])
    ax.set_xlabel(f"vote margin (top − second, of {num_teachers} teachers)")
    ax.set_ylabel("queries")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Teacher consensus on the queries asked")
    return _png(plt, fig)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>veil PATE report: {{ r.dataset.name }}, ε = {{ "%.3g"|format(r.epsilon) }}</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
         color: #1b1b1b; line-height: 1.45; }
  h1 { font-size: 1.6rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
  .guarantee { background: #eef6ee; border-left: 4px solid #2e7d32; padding: 0.8rem 1rem; }
  .caveat { color: #555; font-size: 0.92rem; }
  table { border-collapse: collapse; width: 100%; font-size: 0.93rem; }
  td, th { text-align: left; padding: 0.3rem 0.6rem; border-bottom: 1px solid #eee; vertical-align: top; }
  th { background: #fafafa; width: 30%; } img { max-width: 100%; }
</style>
</head>
<body>
<h1>PATE report: private labels from {{ r.teachers }} teachers</h1>
<p class="caveat">veil {{ r.veil_version }} · dataset <code>{{ r.dataset.name }}</code> ·
aggregator <code>{{ r.aggregator }}</code> · {{ "%.1f"|format(r.duration_s) }} s</p>
<h2>The guarantee</h2>
<p class="guarantee">{{ r.guarantee_statement }}</p>
{% for c in caveats %}<p class="caveat">{{ c }}</p>
{% endfor %}
<h2>Result</h2>
<table>
<tr><th>ε (the {{ r.guarantee }} guarantee)</th><td>{{ "%.4g"|format(r.epsilon) }} at δ = {{ r.delta }}
 (target {{ r.target_epsilon }})</td></tr>
<tr><th>ε data-independent (every dataset)</th><td>{{ "%.4g"|format(r.epsilon_data_independent) }}</td></tr>
<tr><th>ε data-dependent (released)</th><td>{% if r.epsilon_data_dependent is not none %}
{{ "%.4g"|format(r.epsilon_data_dependent) }}{% else %}not analysed for {{ r.aggregator }}{% endif %}
</td></tr>
<tr><th>Queries asked / answered</th><td>{{ r.queries_asked }} / {{ r.queries_answered }}
 (planned {{ r.queries_planned }}; stopped: {{ r.stop_reason }})</td></tr>
<tr><th>Student test accuracy</th><td>{% if r.student_test_accuracy is not none %}
{{ "%.4f"|format(r.student_test_accuracy) }} ({{ r.student_train_size }} labelled examples{% if
 r.student_semi_supervised %}, self-trained on {{ r.student_pseudo_labels }} unlabelled public
 examples{% endif %}){% else %}no student (no label released){% endif %}</td></tr>
<tr><th>Label accuracy (answered vs truth)</th><td>{% if r.label_accuracy is not none %}
{{ "%.4f"|format(r.label_accuracy) }}{% else %}unknown (public pool unlabelled){% endif %}</td></tr>
<tr><th>Teacher accuracy (mean)</th><td>{{ "%.4f"|format(r.teacher_accuracy) }}</td></tr>
</table>
<h2>Parameters</h2>
<table>
<tr><th>Noise</th><td>{% for k, v in r.noise.items() %}{% if v is not none %}{{ k }} = {{ "%.5g"|format(v) }}
 {% endif %}{% endfor %}</td></tr>
<tr><th>Budget / accountant</th><td>{{ r.budget }} / {{ r.accountant }}
 ({{ r.neighbouring }}; unit: {{ r.privacy_unit }})</td></tr>
{% if r.data_dependent %}<tr><th>Data-dependent release</th><td>order λ = {{ r.data_dependent.order }},
 β = {{ "%.4g"|format(r.data_dependent.beta) }}, σ_s = {{ r.data_dependent.sigma_s }},
 confidence {{ r.data_dependent.confidence }}, {{ r.data_dependent.releases }} release(s)</td></tr>{% endif %}
<tr><th>Teachers</th><td>{{ r.teachers }} ({{ r.teacher_model }}),
 partition sizes {{ r.teacher_sizes.min|int }}–{{ r.teacher_sizes.max|int }};
 {{ r.teachers_resumed }} resumed from disk</td></tr>
<tr><th>Student</th><td>{{ r.student_model }}</td></tr>
<tr><th>Data split</th><td>{{ r.dataset.split }}</td></tr>
<tr><th>Randomness</th><td>
 {{ 'OS CSPRNG (secure)' if r.secure_rng else 'seeded (research mode), seed ' ~ r.seed }}</td></tr>
</table>
<h2>Plots</h2>
{% for title, b64 in images.items() %}<h3>{{ title }}</h3>
<img alt="{{ title }}" src="data:image/png;base64,{{ b64 }}">
{% endfor %}
</body>
</html>
"""


def render_html(r: PateReport, images: Mapping[str, bytes]) -> str:
    """The report page; ``images`` maps a title to PNG bytes (embedded, no external assets)."""
    import jinja2

    env = jinja2.Environment(autoescape=True)
    return env.from_string(_TEMPLATE).render(
        r=r,
        caveats=_caveats(r),
        images={t: base64.b64encode(p).decode("ascii") for t, p in images.items()},
    )


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN/inf: map them to None."""
    return None if x is None or not math.isfinite(x) else float(x)
