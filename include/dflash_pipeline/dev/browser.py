"""Headless Chromium (Debian's, driven by Playwright) looking at the progress page like a user.

Shared by the browser test and the demo's `--screenshot`: it logs in through Airflow's own login
page (the plugin accepts nothing else) and waits until the report's plots are loaded, so a
screenshot shows the page as a person would see it. `playwright install` is never used:
scripts/ci_system_deps.sh installs /usr/bin/chromium.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

logger = logging.getLogger(__name__)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 900}


def run_page_path(dag_id: str, run_id: str) -> str:
    return f"/dflash/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def log_in_at_run_page(page: Any, base_url: str, dag_id: str, run_id: str, username: str, password: str) -> None:
    """Open the run's page, follow its "Log in to Airflow" link, sign in, and wait to be back on it."""
    page.goto(f"{base_url}{run_page_path(dag_id, run_id)}")
    page.get_by_role("link", name="Log in to Airflow").click()
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{base_url}/dflash/runs/**")
    page.wait_for_selector("#run-progress")


def wait_for_plots(page: Any) -> None:
    page.wait_for_function("Array.from(document.querySelectorAll('.plots img'))"
                           ".every(i => i.complete && i.naturalWidth > 0)")


def screenshot_run_page(base_url: str, dag_id: str, run_id: str, username: str, password: str, out: Path) -> Path:
    """A full-page PNG of a run's progress page, taken after logging in; returns `out`."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: run scripts/ci_system_deps.sh (apt-get install -y chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(60_000)
            log_in_at_run_page(page, base_url, dag_id, run_id, username, password)
            wait_for_plots(page)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    logger.info("screenshot of %s written to %s", run_id, out)
    return out
