"""Chromium through Playwright, for the tests that drive Airflow's pages in a browser.

The ``browser`` and ``shots`` fixtures of tests/stack/conftest.py use it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

CHROMIUM = "/usr/bin/chromium"
"""Debian's Chromium (.ci/run installs it): Playwright drives it, downloading no browser."""
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Chromium, closed afterwards; without it the test is skipped (failed in CI)."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing (.ci/run installs Debian's chromium)")
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser: Browser, height: int = 860) -> Page:
    """A page of a fresh browser context (1360 pixels wide), each wait bounded at 30 s."""
    context = browser.new_context(viewport={"width": 1360, "height": height})
    page = context.new_page()
    page.set_default_timeout(30_000)
    return page


def follow(page: Page, link: Locator, url: str, timeout_s: float = 30.0) -> None:
    """Click a navigation link until the page is at ``url`` (a glob), within ``timeout_s``.

    A React page can re-render its navigation just after it appears (Airflow 3's does once its
    plugins and permissions load): a click that lands on the element being replaced navigates
    nowhere. A link is safe to click again, so each click waits 5 s before the next.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.monotonic() + timeout_s
    while True:
        link.click(timeout=max(1.0, deadline - time.monotonic()) * 1000)
        wait_ms = min(5.0, deadline - time.monotonic()) * 1000
        try:
            page.wait_for_url(url, timeout=max(wait_ms, 1.0))
            return
        except PlaywrightTimeout:
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"clicking {link} for {timeout_s:.0f} s never reached {url} "
                    f"(the page stayed at {page.url})"
                ) from None
