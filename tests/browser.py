"""A headless Chromium driven through Selenium, for the tests that use a page as a person would.

The browser is Debian's (`apt-get install chromium chromium-driver`: /usr/bin/chromium and /usr/bin/chromedriver);
Selenium is given both paths, so it never looks for or downloads a driver of its own (Selenium Manager), which
would need the network. Where either is missing the tests skip with the reason, except under
DERIV_REQUIRE_BROWSER=1 (which CI's .ci/run exports): there a missing browser is a failure, not a silent skip.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# subtle: without the background-networking, component-update and sync flags, Chromium's first connections
# (to its own update and sync services, which this machine cannot reach) make it refuse the page's.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,1000",
)
INSTALL = "apt-get install chromium chromium-driver (or `make browser`) and pip install 'deriv-lm[dev]'"


def unavailable() -> str | None:
    """Why no browser can be driven here, or None when one can."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        return f"{' and '.join(missing)} not found: {INSTALL}"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return f"selenium is not installed: {INSTALL}"
    return None


def require_browser() -> None:
    """Skip the calling test module without a browser, or fail it when DERIV_REQUIRE_BROWSER=1."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("DERIV_REQUIRE_BROWSER") == "1":
        pytest.fail(f"DERIV_REQUIRE_BROWSER=1 and no browser can be driven: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def start_chromium():
    """A headless Chromium with a fresh profile; `quit_chromium` closes it and removes the profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="deriv-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for the tests to read
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.deriv_profile = profile
    return driver


def quit_chromium(driver) -> None:
    try:
        driver.quit()
    finally:
        shutil.rmtree(driver.deriv_profile, ignore_errors=True)


def screenshot_dirs(tmp: Path) -> list[Path]:
    """Where screenshots go: a temporary folder always, and docs/images (or the folder DERIV_SCREENSHOTS names,
    relative to the checkout) only when it is set."""
    folders = [tmp]
    wanted = os.environ.get("DERIV_SCREENSHOTS")
    if wanted:
        folders.append(Path(__file__).resolve().parent.parent / wanted)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    return folders


def save_screenshots(driver, name: str, folders: list[Path], sections: tuple[str, ...] = ()) -> list[Path]:
    """The whole page (the window stretched to the page's height) and each named section, as PNG files."""
    from selenium.webdriver.common.by import By

    width = driver.get_window_size()["width"]
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, height + 120)
    written = []
    try:
        for folder in folders:
            path = folder / f"explore-{name}.png"
            driver.find_element(By.TAG_NAME, "body").screenshot(str(path))
            written.append(path)
            for section in sections:
                path = folder / f"explore-{name}-{section}.png"
                driver.find_element(By.ID, section).screenshot(str(path))
                written.append(path)
    finally:
        driver.set_window_size(width, 1000)
    return written
