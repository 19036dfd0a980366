"""TOML syntax errors told by the line at fault, for the one-line messages of config and schema files.

``tomllib`` reports where it *noticed* a problem: an unclosed array or string is noticed at the start
of the next line ("at line 6, column 1"), one line after the line a person must fix. :func:`where`
names the line to fix and quotes it.
"""

from __future__ import annotations

import re

__all__ = ["where"]

_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def where(text: str, error: Exception) -> str:
    """``error`` (a TOML decode error on ``text``) as "what, at line N: `the line`"."""
    message = str(error)
    found = _POSITION.search(message)
    what = _POSITION.sub("", message) if found else message
    if found is None:
        return what
    lines = text.splitlines()
    line, column = int(found.group(1)), int(found.group(2))
    at_start = column == 1 and line > 1
    if at_start:  # noticed at the start of a line: the line to fix is the last non-blank one before it
        line -= 1
        while line > 1 and not lines[line - 1].strip():
            line -= 1
    shown = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    place = f"at the end of line {line}" if at_start else f"at line {line}, column {column}"
    return f"{what}, {place}" + (f": `{shown}`" if shown else "")
