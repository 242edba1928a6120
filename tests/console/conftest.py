"""Headless Chromium driven by Selenium, for the console's end-to-end tests.

The browser and its driver come from Debian (``chromium``, ``chromium-driver``; ``make browser`` installs
them, and ``make test`` runs it first); Selenium comes from the ``test`` extra. The driver is given both
paths, so Selenium Manager never tries to download a browser or a driver. When either is missing the test
fails and says what to install: a console nobody has opened in a browser is not tested.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INSTALL_HINT = (
    "run `make browser` (as root: apt-get update && apt-get install -y chromium chromium-driver) "
    "and `pip install -e '.[test]'` (selenium)"
)
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A Selenium Chrome driver on Debian's Chromium, with a fresh profile and downloads into tmp_path."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: {INSTALL_HINT}")
    chromium = _find("chromium", "chromium-browser")
    chromedriver = _find("chromedriver")
    if chromium is None or chromedriver is None:
        missing = ", ".join(n for n, p in (("chromium", chromium), ("chromedriver", chromedriver)) if p is None)
        pytest.fail(f"the console's browser test needs {missing}: {INSTALL_HINT}")

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(
        options=options, service=Service(executable_path=chromedriver, log_output=str(tmp_path / "chromedriver.log"))
    )
    try:
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        driver.set_page_load_timeout(30)
        driver.downloads = downloads  # where clicked downloads land
        yield driver
    finally:
        driver.quit()
