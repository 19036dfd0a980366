"""The one report stack: a jinja Environment over the packaged templates, used by every job.

Every page extends ``templates/page.html.j2``, which fixes the skeleton (guarantee, result,
checklist, parameters, plots, files) and the style; a job's template fills the blocks. Pages are
self-contained (plots embedded as base64 PNG, no script, no external asset) and every value is
HTML-escaped.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

__all__ = ["environment", "render_page"]


@functools.cache
def environment() -> jinja2.Environment:
    """The Environment every report page is rendered with (templates from ``veil.report``)."""
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("veil.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def render_page(template: str, images: Mapping[str, bytes], **context: Any) -> str:
    """Render ``template`` (a file of ``veil/report/templates``, extending ``page.html.j2``).

    ``images`` maps a plot's title to its PNG bytes (embedded in the Plots section); ``context``
    holds the template's own variables."""
    encoded = {title: base64.b64encode(png).decode("ascii") for title, png in images.items()}
    return environment().get_template(template).render(images=encoded, **context)
