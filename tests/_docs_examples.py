"""The code blocks of a page under ``docs/``, in order, so tests can run what the docs show."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def code_blocks(page: str, language: str) -> list[str]:
    """Every fenced ``language`` block of ``docs/<page>``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)
