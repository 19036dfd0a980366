"""``report.html``: one self-contained page (plots embedded as base64 PNG, no external assets)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from veil.report import Report

__all__ = ["exp_factor", "guarantee_text", "render_html"]


def exp_factor(epsilon: float) -> str:
    """e^ε in words, without overflowing for a huge ε (e^710 passes a float)."""
    if epsilon > 700:
        return f"10^{epsilon / math.log(10):.4g}"
    return f"{math.exp(epsilon):.3g}"


def guarantee_text(report: Report) -> str:
    """The guarantee in plain words: what it covers exactly, and research mode's caveat."""
    d = report.dataset
    unit = report.privacy_unit
    whom = (
        f"the {d.n_train} training examples of '{d.name}': adding or removing any one training example"
        if unit is None
        else f"the {unit['units']} people of '{d.name}', each person (unit column `{unit['column']}`), "
        "whatever number of rows they have: adding or removing any one person with all their rows"
    )
    text = (
        f"The released model weights are ({report.epsilon_spent:.3g}, "
        f"{report.delta:g})-differentially private "
        f"with respect to {whom} "
        f"changes the probability of any outcome by at most a factor e^{report.epsilon_spent:.3g} "
        f"≈ {exp_factor(report.epsilon_spent)}, except with probability at most {report.delta:g}. "
        f"It covers the weights as trained by {report.steps} noisy steps "
        f"(Poisson sampling at rate {report.sampling_rate:.4g}, "
        f"clip norm {report.max_grad_norm:g}, noise multiplier "
        f"{report.noise_multiplier:.4g}) after the preprocessing "
        f"({report.preprocessing.get('method')}), composed by the "
        f"{report.accountant.upper()} accountant. It does not cover the internal, non-private section "
        "below (test metrics, a non-private release about the held-out rows; the non-private baseline; "
        "any audit) nor the dataset fingerprint; N and the label set are public by declaration."
    )
    if unit is None:
        text += (
            " Each row is protected on its own: a person with several rows gets weaker protection "
            "(group privacy, about k·ε for k rows); name the person's column with --privacy-unit."
        )
    if report.randomness != "secure":
        text += (
            " Research mode: the noise came from a generator seeded by the run's seed, so this model is "
            "not private against anyone who knows the seed. Not release-ready."
        )
    return text


def _caveats(report: Report) -> list[str]:
    out = [
        "The number of training examples N is treated as public, as is usual for DP-SGD (q = B/N).",
        f"Label set: {', '.join(report.label_set.get('classes', []))} "
        f"(declared by {report.label_set.get('declared_by')}).",
    ]
    if report.randomness != "secure":
        out.append(
            "Noise and sampling came from a seeded generator (research mode, --reproducible): anyone who "
            "knows the seed could recompute the noise. Train a model for release without --reproducible."
        )
    return out


def render_html(
    report: Report,
    images: Mapping[str, bytes],
    summary: str = "",
    dataset_budget: Mapping[str, Any] | None = None,
) -> str:
    """The report page (``templates/train.html.j2``); ``images`` maps a title to PNG bytes; the plain
    ``summary`` and the ``dataset_budget`` section come first when given."""
    from veil.report.render import render_page

    return render_page(
        "train.html.j2",
        images,
        r=report,
        guarantee=guarantee_text(report),
        caveats=_caveats(report),
        checks=report.checks,
        files=report.files,
        summary=summary,
        dataset_budget=dataset_budget,
        elsewhere=_labelled_elsewhere(report),
    )


def _labelled_elsewhere(report: Report) -> list[tuple[str, Any, str]]:
    """(path, its value, why it is non-private) for each path the non_private section labels."""
    data = report.to_dict()
    rows = []
    for path, why in report.non_private.labelled_elsewhere.items():
        value: Any = data
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        rows.append((path, "–" if value is None else value, why))
    return rows
