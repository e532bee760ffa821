"""What the studio's tests share: an app over a runs directory, a live server on a free port in a
thread, one headless Chromium per test module (Debian's /usr/bin/chromium driven by Playwright),
and screenshots.

    from studio_support import browser, make_app, serve, open_page, shot   # noqa: F401 (fixture)

    def test_x(tmp_path, browser):
        app = make_app(tmp_path / "runs")
        with serve(app) as url:
            page = open_page(browser, url + "/runs")
            ...
            shot(page, "runs", tmp_path)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# Chromium never reaches the network in tests (and never downloads anything)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[1]
README_IMG = REPO / "docs" / "img"


def make_app(runs_dir, token: str | None = None, **cfg):
    """The studio app over `runs_dir` (created if missing); `cfg`: other StudioConfig fields."""
    from tether.studio.app import create_app
    from tether.studio.command import StudioConfig

    Path(runs_dir).mkdir(parents=True, exist_ok=True)
    return create_app(StudioConfig(runs_dir=str(runs_dir), **cfg), token=token)


def client(app):
    """A TestClient that speaks to the app as a loopback browser would (Host: 127.0.0.1)."""
    from fastapi.testclient import TestClient

    return TestClient(app, base_url="http://127.0.0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, host: str = "127.0.0.1"):
    """Serve `app` with uvicorn in a thread on a free port; yields the base URL (no trailing /)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the studio server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the whole test module (starting one costs about a second)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} missing: apt-get install -y chromium (.ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url: str, width: int = 1280, height: int = 900):
    """A fresh page (own context: own cookies) at `url`; page errors fail the test when checked
    with `assert_no_errors(page)`."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    return page


def wait_until(page, predicate, timeout: float = 5.0, what: str = "") -> float:
    """Poll `predicate()` (Python, reading the page with get_attribute / text_content / locator
    counts) every 50 ms until true; returns the seconds it took, fails after `timeout`. (The
    studio's Content-Security-Policy forbids eval, which Playwright's wait_for_function needs.)"""
    t0 = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - an element not there yet
            pass
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what or predicate}")
        page.wait_for_timeout(50)


def value_of(page, selector: str) -> float | None:
    """The number a `T.num(x)` element shows, at full precision (its data-value); None if absent."""
    v = page.get_attribute(selector, "data-value", timeout=1000)
    return None if v in (None, "") else float(v)


def assert_no_errors(page):
    assert page.errors == [], f"errors in the page: {page.errors}"


def shot(page, name: str, out_dir) -> Path:
    """Screenshot of the whole page into the test's output folder as <name>.png; with
    TETHER_STUDIO_README_IMG=1 also copied to docs/img/studio-<name>.png (the README's pictures)."""
    out = Path(out_dir) / f"{name}.png"
    page.screenshot(path=str(out), full_page=True)
    if os.environ.get("TETHER_STUDIO_README_IMG") == "1":
        README_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, README_IMG / f"studio-{name}.png")
    return out
