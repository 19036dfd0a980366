"""``report.html``: one self-contained page (plots embedded as base64 PNG, no external assets)."""

from __future__ import annotations

from collections.abc import Mapping

from veil.report import Report

__all__ = ["guarantee_text", "render_html"]


def guarantee_text(report: Report) -> str:
    """The guarantee in plain words."""
    d = report.dataset
    return (
        f"The released model weights are ({report.epsilon_spent:.3g}, "
        f"{report.delta:g})-differentially private "
        f"with respect to the {d.n_train} training examples "
        f"of '{d.name}': adding or removing any one training "
        f"example changes the probability of any outcome by at most a factor e^{report.epsilon_spent:.3g} "
        f"≈ {2.718281828459045**report.epsilon_spent:.3g}, except with probability at most {report.delta:g}. "
        f"This covers every use of the training examples in the run: {report.steps} noisy training steps "
        f"(Poisson sampling at rate {report.sampling_rate:.4g}, "
        f"clip norm {report.max_grad_norm:g}, noise multiplier "
        f"{report.noise_multiplier:.4g}) and the preprocessing "
        f"({report.preprocessing.get('method')}), composed by the "
        f"{report.accountant.upper()} accountant."
    )


def _caveats(report: Report) -> list[str]:
    out = [
        "The test accuracy and the non-private baseline are "
        "diagnostics computed without privacy: they are not "
        "covered by the guarantee. Keep this report internal; release the model weights only.",
        "The number of training examples N is treated as public, as is usual for DP-SGD (q = B/N).",
    ]
    if not report.secure_rng:
        out.append(
            "Noise and sampling came from a seeded generator "
            "(research mode): anyone who knows the seed could "
            "recompute the noise. Train a model for release with --secure-rng."
        )
    return out


def render_html(report: Report, images: Mapping[str, bytes]) -> str:
    """The report page (``templates/train.html.j2``); ``images`` maps a title to PNG bytes."""
    from veil.report.render import render_page

    return render_page(
        "train.html.j2",
        images,
        r=report,
        guarantee=guarantee_text(report),
        caveats=_caveats(report),
        checks=report.checks,
        files=report.files,
    )
