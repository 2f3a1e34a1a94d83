"""The dashboard of a real job under ``tensorfleet launch --dashboard``: a killed worker restarts on the page."""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import LauncherProcess

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parents[1] / "integration" / "paced_job.py"


def cell(page: Page, task: str, field: str):
    return page.locator(f'tr[data-task="{task}"] td[data-field="{field}"]')


@pytest.fixture
def job(tmp_path):
    # --stop_file: the test ends training once it has seen the restart (the job would go on to step 1500)
    run = LauncherProcess(tmp_path / "logs", ["--ps", "1", "--workers", "2", "--dashboard", "--restart-backoff", "3"],
                          PACED, ["--last_step", "1500", "--step_sleep_s", "0.01",
                                  "--stop_file", str(tmp_path / "stop")])
    yield run
    run.kill()


def test_a_running_cluster_is_shown_and_a_killed_worker_restarts_on_the_page(browser_page: Page, job,
                                                                              save_screenshot, tmp_path):
    url = poll(lambda: next(iter(re.findall(r"dashboard at (http://127\.0\.0\.1:\d+/)", job.output)), None), 60,
               "the launcher to print the dashboard's address")
    page = browser_page
    page.goto(url)
    expect(page.locator("#task-rows tr")).to_have_count(3)
    for task, role in [("ps:0", "ps"), ("worker:0", "chief"), ("worker:1", "worker")]:
        expect(cell(page, task, "role")).to_have_text(role)
        expect(cell(page, task, "state")).to_have_text("running", timeout=60_000)
    expect(page.locator("#job-name")).to_have_text("paced-job")
    poll(lambda: int(page.locator("#global-step").get_attribute("data-value") or 0) > 50, 30,
         "the page to show training under way", interval_s=0.2)

    pid = job.events_of("worker:1", "started")[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    expect(cell(page, "worker:1", "state")).to_have_text("restarting")
    expect(cell(page, "worker:1", "exit_code")).to_have_text(str(-signal.SIGKILL))
    expect(cell(page, "worker:1", "restarts")).to_have_text("1")
    expect(cell(page, "worker:1", "state")).to_have_text("running", timeout=60_000)
    expect(cell(page, "worker:1", "pid")).not_to_have_text(str(pid))
    save_screenshot(page, "dashboard-live.png")

    metrics = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    assert re.search(r'tensorfleet_task_restarts_total\{[^}]*task="worker:1"[^}]*\} 1\.0', metrics), metrics
    assert re.search(r"tensorfleet_global_step \d+", metrics)
    (tmp_path / "stop").touch()
    code, output = job.wait()
    assert code == 0, output
