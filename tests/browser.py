"""The browser tests' side of `deriv_lm.viz.explorer.browser` (headless Debian Chromium through Selenium): skip or
fail without one, and screenshots. Where Chromium or Selenium is missing the tests skip with the reason, except under
DERIV_REQUIRE_BROWSER=1 (which CI's .ci/run exports): there a missing browser is a failure, not a silent skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deriv_lm.viz.explorer.browser import quit_chromium, start_chromium, unavailable  # noqa: F401 (re-exported)


def require_browser() -> None:
    """Skip the calling test module without a browser, or fail it when DERIV_REQUIRE_BROWSER=1."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("DERIV_REQUIRE_BROWSER") == "1":
        pytest.fail(f"DERIV_REQUIRE_BROWSER=1 and no browser can be driven: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


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
