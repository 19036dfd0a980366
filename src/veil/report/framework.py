"""``report.html`` of a run trained inside another framework's loop (:mod:`veil.pipeline.external`)."""

from __future__ import annotations

from typing import Any

__all__ = ["render_framework_html"]


def render_framework_html(report: dict[str, Any]) -> str:
    """The page (``templates/framework.html.j2``) for the report dict that ``report.json`` holds."""
    from veil.report.plots import epsilon_png
    from veil.report.render import render_page

    curve = [(int(p["step"]), float(p["epsilon"])) for p in report["epsilon_curve"]]
    images = {}
    if len(curve) > 1:
        images["ε spent against the step"] = epsilon_png(
            curve, report["target_epsilon"], report["steps"], report["delta"]
        )
    return render_page("framework.html.j2", images, r=report, checks=report["checks"], files=report["files"])
