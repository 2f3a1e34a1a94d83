"""Browser tests drive Debian's chromium (``apt-get install chromium``) through Playwright's sync API.

Playwright never downloads a browser here: it is pointed at ``/usr/bin/chromium``.
Without that binary the tests are skipped, except on CI (``CI=true``), where
``.ci/run`` installs it first: a browser missing there fails, unless ``.ci/run``
said it could not be installed (``TENSORFLEET_NO_BROWSER``, loudly, in the CI log).  One Playwright driver and
browser serve every test of a module (starting them costs ~0.7 s a test); each test gets a fresh browser context of its
own (no cookie, no storage of another test), closed when it ends.  The root conftest's check for leftover processes
leaves the module's driver and browser out (``keep_processes``); they are closed when the module ends.  Every wait is
bounded: Playwright's default timeouts are set here.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from tensorfleet.dashboard import Dashboard
from tensorfleet.testing.fake_monitor import FakeMonitor, serving

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAUNCH_TIMEOUT_MS = 30_000
ACTION_TIMEOUT_MS = 10_000
VIEWPORT = {"width": 1440, "height": 1000}

expect.set_options(timeout=ACTION_TIMEOUT_MS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is a browser test."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.browser)


class _SharedBrowser:
    """The module's chromium, started at the first test that asks, started again if it went away."""

    def __init__(self, keeper) -> None:
        self.keeper = keeper
        self.playwright = self.browser = None
        self.kept: set[int] = set()

    def get(self) -> Browser:
        if self.browser is not None and self.browser.is_connected():
            return self.browser
        self.close()
        before = {p.pid for p in psutil.Process().children()}
        self.playwright = sync_playwright().start()
        try:
            self.browser = self.playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=LAUNCH_TIMEOUT_MS)
        finally:  # the driver (and chromium under it) outlives each test of the module: not a leftover
            self.kept = {p.pid for p in psutil.Process().children()} - before
            self.keeper.keep(self.kept)
        return self.browser

    def close(self) -> None:
        try:
            if self.browser is not None:
                self.browser.close()
            if self.playwright is not None:
                self.playwright.stop()
        finally:
            self.keeper.release(self.kept)
            self.playwright = self.browser = None
            self.kept = set()


@pytest.fixture(scope="module")
def _shared_browser(keep_processes) -> Iterator[_SharedBrowser]:
    shared = _SharedBrowser(keep_processes)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def browser_page(request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh page in a fresh context of headless chromium, 1440x1000; uncaught JavaScript errors fail the test."""
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is missing: apt-get install chromium"
        if os.environ.get("CI") == "true" and not os.environ.get("TENSORFLEET_NO_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    errors: list[str] = []
    context = request.getfixturevalue("_shared_browser").get().new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.set_default_timeout(ACTION_TIMEOUT_MS)
        page.set_default_navigation_timeout(ACTION_TIMEOUT_MS)
        page.on("pageerror", lambda error: errors.append(str(error)))
        yield page
    finally:
        context.close()
    assert not errors, f"uncaught JavaScript errors on the page: {errors}"


@pytest.fixture
def service_home(tmp_path: Path) -> Path:
    """The job service's home for a test whose pages are screenshots of the docs: $TENSORFLEET_SCREENSHOT_HOME
    (a new folder, so that the pictures show a neutral path, not a pytest temporary one), else tmp_path/home."""
    chosen = os.environ.get("TENSORFLEET_SCREENSHOT_HOME")
    if not chosen:
        return tmp_path / "home"
    home = Path(chosen)
    if home.exists() and any(home.iterdir()):
        pytest.fail(f"TENSORFLEET_SCREENSHOT_HOME={chosen} is not empty: give a new folder")
    return home


@pytest.fixture
def save_screenshot(tmp_path: Path) -> Callable[[Page, str], Path]:
    """``save_screenshot(page, "name.png")``: a full-page PNG in $TENSORFLEET_SCREENSHOT_DIR, else tmp_path."""
    folder = Path(os.environ.get("TENSORFLEET_SCREENSHOT_DIR") or tmp_path)

    def save(page: Page, name: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        try:
            page.screenshot(path=str(path), full_page=True, animations="disabled", timeout=ACTION_TIMEOUT_MS)
        except PlaywrightError as error:
            pytest.fail(f"could not save the screenshot {path}: {error}")
        return path

    return save


def fake_picture(points: int = 60) -> dict:
    """A realistic fleet: 2 ps and 3 workers (one restarting), ``points`` polls of history."""
    noise = random.Random(0)
    history = []
    for i in range(points):
        rate = 47000.0 * (1 - 0.6 * 0.85 ** i) * noise.uniform(0.97, 1.03)
        history.append({
            "t": 0.5 * (i + 1), "global_step": 250 * (i + 1),
            "loss": round((2.3 * 0.94 ** i + 0.12) * noise.uniform(0.96, 1.04), 4),
            "examples_per_sec": round(rate, 1), "steps_per_sec": round(rate / 100, 2),
        })
    step = history[-1]["global_step"] if history else 0

    def task(name: str, role: str, port: int, **fields) -> dict:
        return {"name": name, "role": role, "address": f"127.0.0.1:{port}", "state": "running",
                "pid": 41000 + port % 1000, "restarts": 0, "step": None, "global_step": step, "loss": None,
                "examples_per_sec": None, "heartbeat_age_s": 0.3, "exit_code": None, **fields}

    return {
        "job": {"name": "mnist_mlp", "mode": "async", "state": "running", "global_step": step,
                "target_step": 30000, "steps_per_sec": 468.2, "examples_per_sec": 46820.0,
                "eta_s": (30000 - step) / 468.2, "dropped_stale": 0, "elapsed_s": 31.6, "restarts": 1},
        "tasks": [
            task("ps:0", "ps", 41230, step=step),
            task("ps:1", "ps", 41231, step=step, heartbeat_age_s=0.5),
            task("worker:0", "chief", 41232, step=5120, loss=0.1312, examples_per_sec=16210.0),
            task("worker:1", "worker", 41233, state="restarting", pid=None, restarts=1, step=3411,
                 global_step=step - 2750, loss=0.1584, heartbeat_age_s=6.2, exit_code=-9),
            task("worker:2", "worker", 41234, step=5098, loss=0.1297, examples_per_sec=15980.0,
                 heartbeat_age_s=0.2),
        ],
        "history": history,
    }


@pytest.fixture
def fleet() -> FakeMonitor:
    return FakeMonitor(fake_picture())


@pytest.fixture
def dashboard(fleet: FakeMonitor) -> Iterator[Dashboard]:
    """A real Dashboard on a free loopback port over ``fleet``."""
    with serving(fleet) as dashboard:
        yield dashboard