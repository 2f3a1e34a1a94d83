"""The job service in a browser, as a user drives it: sign in, create an MNIST job from the form and watch it
succeed, clone it with 3 workers and stop it mid-run, restart the service and find both; and what it refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import Page, expect

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import ADMIN_PASSWORD, start_service, stop_runners

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_MS = 180_000


def sign_in(page: Page, url: str) -> None:
    page.goto(url + "/")
    expect(page).to_have_url(re.compile(r"/login\?next=/$"))
    page.fill("#user", "admin")
    page.fill("#password", ADMIN_PASSWORD)
    page.click("#sign-in")
    expect(page.locator("#user-name")).to_have_text("admin (admin)")


def task_pids(home: Path, job_id: int) -> list[int]:
    try:
        picture = json.loads((home / "jobs" / str(job_id) / "picture.json").read_text())
    except FileNotFoundError:
        return []
    return [t["pid"] for t in picture["tasks"] if t.get("pid")]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_user_runs_stops_and_finds_jobs_from_the_browser_only(browser_page: Page, tmp_path, save_screenshot):
    home, page = tmp_path / "home", browser_page
    service = start_service(home, REPO)
    try:
        sign_in(page, service.url)

        # Create a 2-worker MNIST job from the form.
        page.click("#new-job-link")
        page.select_option("#script", "examples/mnist_mlp.py")
        page.fill("#args", "--train_steps 1500 --moving_average_decay 0.99")
        page.fill("#workers", "2")
        page.select_option("#mode", "async")
        page.click("#create")
        expect(page).to_have_url(re.compile(r"/jobs/1$"))
        expect(page.locator("#job-state")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
        page.click('#log-tabs button[data-task="worker:0"]')
        expect(page.locator("#log")).to_contain_text(re.compile(r"test accuracy: 0\.\d{4}"))
        expect(page.locator("#tasks tbody tr")).to_have_count(3)
        expect(page.locator('#tasks tr[data-task="worker:1"]')).to_contain_text("TF_CONFIG=")
        expect(page.locator("#tensorboard")).to_contain_text(str(home / "jobs" / "1"))
        dashboard = page.frame_locator("#dashboard")
        expect(dashboard.locator("#task-rows tr")).to_have_count(3)
        save_screenshot(page, "service-job.png")

        # Clone it with 3 workers (the form comes prefilled), and stop the clone mid-run.
        page.click("#clone")
        expect(page.locator("#script")).to_have_value("examples/mnist_mlp.py")
        expect(page.locator("#args")).to_have_value("--train_steps 1500 --moving_average_decay 0.99")
        page.fill("#args", "--train_steps 200000")
        page.fill("#workers", "3")
        page.click("#create")
        expect(page).to_have_url(re.compile(r"/jobs/2$"))
        expect(page.locator("#job-state")).to_have_text("running", timeout=60_000)
        pids = poll(lambda: len(task_pids(home, 2)) == 4 and task_pids(home, 2), 90, "the clone's 4 tasks")
        runner = service.job(2)["pid"]
        page.click("#stop")
        expect(page.locator("#job-state")).to_have_text("stopped", timeout=60_000)
        expect(page.locator("#job-reason")).to_have_text("stopped by admin")
        poll(lambda: not any(running(pid) for pid in pids + [runner]), 30, "every process of the clone to exit")

        # A third job to see in the list while it runs, then the list itself.
        page.goto(service.url + "/jobs/new?from=1")
        page.fill("#name", "mnist-long")
        page.fill("#args", "--train_steps 200000")
        page.click("#create")
        expect(page.locator("#job-state")).to_have_text("running", timeout=60_000)
        page.goto(service.url + "/")
        expect(page.locator('tr[data-job="3"] td[data-field="progress"]')).to_contain_text("/ 200000", timeout=60_000)
        expect(page.locator('tr[data-job="1"] td[data-field="state"]')).to_have_text("succeeded")
        save_screenshot(page, "service-jobs.png")

        # Restart the service: both finished jobs keep their states, the running one is re-attached.
        port = int(service.url.rsplit(":", 1)[1])
        service.service.close()
        service.service.store.close()
        service = start_service(home, REPO, port=port)
        page.goto(service.url + "/")
        expect(page.locator('tr[data-job="1"] td[data-field="state"]')).to_have_text("succeeded")
        expect(page.locator('tr[data-job="2"] td[data-field="state"]')).to_have_text("stopped")
        expect(page.locator('tr[data-job="3"] td[data-field="state"]')).to_have_text("running")
        page.click('a[data-state="stopped"]')
        expect(page.locator("#job-rows tr")).to_have_count(1)

        # What it refuses: a POST without the CSRF token (the cookie alone), an API call without a session.
        refused = page.request.post(service.url + "/jobs/3/stop", form={"x": "1"}, max_redirects=0)
        assert refused.status == 403
        assert service.job(3)["state"] == "running" and service.job(3)["stop_requested"] is None
        stranger = page.context.browser.new_context()
        try:
            answer = stranger.request.get(service.url + "/api/jobs")
            assert answer.status == 401 and "sign in first" in answer.json()["error"]
            assert stranger.request.get(service.url + "/jobs/1", max_redirects=0).status == 303
        finally:
            stranger.close()
        page.goto(service.url + "/jobs/3")
        page.click("#stop")
        expect(page.locator("#job-state")).to_have_text("stopped", timeout=60_000)
    finally:
        service.service.close()
        service.service.store.close()
        stop_runners(home)


def test_the_form_imports_a_job_file_and_shows_the_launchers_errors(browser_page: Page, tmp_path):
    home, page = tmp_path / "home", browser_page
    good, bad = tmp_path / "job.yaml", tmp_path / "bad.toml"
    good.write_text("script: examples/mnist_cnn.py\nargs: [--train_steps, 300]\nworkers: 3\nmode: sync\n"
                    "max-restarts: 1\nenv: {OMP_NUM_THREADS: 1}\n")
    bad.write_text('script = "examples/mnist_cnn.py"\nwokers = 3\n')
    service = start_service(home, REPO)
    try:
        sign_in(page, service.url)
        page.goto(service.url + "/jobs/new")
        page.set_input_files("#job-file", str(good))
        page.click("#import")
        expect(page.locator("#script")).to_have_value("examples/mnist_cnn.py")
        expect(page.locator("#args")).to_have_value("--train_steps 300")
        expect(page.locator("#workers")).to_have_value("3")
        expect(page.locator("#mode")).to_have_value("sync")
        expect(page.locator("#max-restarts")).to_have_value("1")
        expect(page.locator("#env")).to_have_value("OMP_NUM_THREADS=1")

        page.set_input_files("#job-file", str(bad))
        page.click("#import")
        expect(page.locator("#form-error")).to_contain_text("unknown field(s) wokers; valid fields:")

        page.fill("#workers", "2")
        page.fill("#gpus", "1000")  # the browser checks the bounds of the numbers; the service, the rest
        page.click("#create")
        expect(page.locator("#form-error")).to_contain_text("needs 2000 GPU(s); this machine has")
        page.fill("#gpus", "0")
        page.fill("#args", "--x 'open")
        page.click("#create")
        expect(page.locator("#form-error")).to_contain_text("args: No closing quotation")
        assert service.client().call("GET", "/api/jobs")["jobs"] == []
    finally:
        service.service.close()
        service.service.store.close()
        stop_runners(home)
