"""The report pages in a real browser: Debian's Chromium driven by Playwright (never a downloaded one).

``veil budget report``'s page and a train run's pages (the full internal one and release/'s public
one) must render, their links must resolve, and nothing may overflow at a phone's 390 px width
(``document.documentElement.scrollWidth <= 390``). Without Chromium or Playwright the tests skip,
except in CI (``CI=true``), where ``make test`` installs both (``.ci/install-chromium.sh``) and a skip
would hide a broken page: there they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from veil.cli.main import main

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PHONE = {"width": 390, "height": 844}


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI installs Chromium and Playwright (.ci/install-chromium.sh), so it must run")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        _unavailable("playwright is not installed (pip install 'veil[test]')")
    if not Path(CHROMIUM).is_file():
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _check_page(browser: Any, page_file: Path) -> list[str]:
    """Open ``page_file`` at 390 px: it renders, nothing overflows sideways; returns its link targets."""
    page = browser.new_page(viewport=PHONE)
    try:
        page.goto(page_file.resolve().as_uri())
        assert page.title() and page.locator("h1").count() == 1
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"{page_file.name} is {width} px wide at a {PHONE['width']} px screen"
        images = page.evaluate("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
        assert all(images)
        return list(page.evaluate("Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"))
    finally:
        page.close()


def test_budget_report_page_renders_links_resolve_and_fits_a_phone(
    browser: Any, job_runs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, report = job_runs("train")
    registry = run_dir.parent / "registry" / "budget.db"
    out = tmp_path / "budget-report"
    assert main(["budget", "report", "--db", str(registry), "--out", str(out)]) == 0
    assert "1 dataset(s)" in capsys.readouterr().out
    links = _check_page(browser, out / "index.html")
    assert len(links) == 2  # the run's full report and its public one
    for href in links:
        target = Path(unquote(urlparse(href).path))
        assert target.is_file(), href
        assert _check_page(browser, target) is not None  # the linked page renders and fits too
    page = (out / "index.html").read_text()
    assert report["dataset_budget"]["runs"][0]["run_id"][:12] in page and "data:image/png;base64," in page


def test_train_report_pages_fit_a_phone(browser: Any, job_runs: Any) -> None:
    run_dir, _ = job_runs("train")
    for page in (run_dir / "report.html", run_dir / "release" / "report.html"):
        assert _check_page(browser, page) == []
