"""A headless Chromium driven through Selenium: how the tests and the latency measurement use the page as a person
would (keys typed, controls moved, the drawn page read back).

The browser is Debian's (`apt-get install chromium chromium-driver`, or `make browser`: /usr/bin/chromium and
/usr/bin/chromedriver). Selenium is given both paths, so it never looks for or downloads a driver of its own
(Selenium Manager), which would need the network. Selenium is in the `dev` extra.
"""

from __future__ import annotations

import os
import shutil
import tempfile


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# subtle: without the background-networking, component-update and sync flags, Chromium's first connections
# (to its own update and sync services, which a closed network refuses) make it refuse the page's.
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
