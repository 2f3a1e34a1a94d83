"""The job service in a browser, as a user drives it: sign in, create an MNIST job from the form and watch it
succeed, clone it with 3 workers and stop it mid-run, restart the service and find both; and what it refuses:
every error of every form (sign-in, the new job, a job file imported, the job page's buttons) on the page, with
a 4xx status, never a 500."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import Page, expect

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import ADMIN_PASSWORD, ServiceUnderTest, start_service, stop_runners

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "integration"  # small paced jobs: paced_job.py, scale_job.py
JOB_TIMEOUT_MS = 180_000
SLOW = ["--last_step", "100000", "--step_sleep_s", "0.02"]


def sign_in(page: Page, url: str, user: str = "admin", password: str = ADMIN_PASSWORD) -> None:
    page.goto(url + "/")
    expect(page).to_have_url(re.compile(r"/login\?next=/$"))
    page.fill("#user", user)
    page.fill("#password", password)
    page.click("#sign-in")
    expect(page.locator("#user-name")).to_have_text(user + (" (admin)" if user == "admin" else ""))


def click_for(page: Page, selector: str, path: str) -> int:
    """Click ``selector`` (a form's button) and return the status of the POST to ``path`` it sends."""
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith(path)) as answer:
        page.click(selector)
    page.wait_for_load_state()
    return answer.value.status


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A workspace: two runnable jobs, a script that crashes, and a module that is no job."""
    folder = tmp_path / "workspace"
    (folder / "lib").mkdir(parents=True)
    for name in ("paced_job.py", "scale_job.py"):
        shutil.copy(JOBS / name, folder / name)
    (folder / "crash.py").write_text("import tensorfleet\n\nif __name__ == '__main__':\n"
                                     "    raise RuntimeError('the model does not fit: on purpose')\n")
    (folder / "lib" / "helpers.py").write_text("def helper():\n    return 1\n")
    return folder


@pytest.fixture
def service(tmp_path: Path, workspace: Path) -> Iterator[ServiceUnderTest]:
    under_test = start_service(tmp_path / "home", workspace, slots=16)
    try:
        yield under_test
    finally:
        under_test.service.close()
        under_test.service.store.close()
        stop_runners(tmp_path / "home")


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


def test_a_user_runs_stops_and_finds_jobs_from_the_browser_only(browser_page: Page, service_home, save_screenshot):
    home, page = service_home, browser_page
    service = start_service(home, REPO)
    try:
        sign_in(page, service.url)

        # Create a 2-worker MNIST job from the form.
        page.click("#new-job-link")
        page.select_option("#script", "examples/mnist_mlp.py")
        page.fill("#args", "--train_steps 400 --moving_average_decay 0.99")
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
        expect(page.locator("#name")).to_have_value("mnist-mlp-copy")  # a name of its own, to be changed at will
        expect(page.locator("#script")).to_have_value("examples/mnist_mlp.py")
        expect(page.locator("#args")).to_have_value("--train_steps 400 --moving_average_decay 0.99")
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
        expect(page.locator("#form-error")).to_contain_text(
            "unknown field(s) wokers (did you mean workers?); valid fields:")

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


def test_sign_in_says_what_went_wrong_and_when_it_is_busy(browser_page: Page, service):
    page, url = browser_page, service.url
    page.goto(url + "/jobs/new")
    expect(page).to_have_url(re.compile(r"/login\?next=/jobs/new$"))
    for user in ("admin", "nobody"):  # a wrong password and an unknown user read alike
        page.fill("#user", user)
        page.fill("#password", "not-the-password")
        assert click_for(page, "#sign-in", "/login") == 401
        expect(page.locator("#login-error")).to_have_text("wrong user name or password")
        expect(page.locator("#user")).to_have_value(user)  # kept, to correct the password only
    checks = service.service.accounts._checks
    held = [checks.acquire(blocking=False) for _ in range(2)]  # two sign-ins being checked: the limit
    try:
        assert all(held)
        page.fill("#user", "admin")
        page.fill("#password", ADMIN_PASSWORD)
        assert click_for(page, "#sign-in", "/login") == 429
        expect(page.locator("#login-error")).to_have_text("too many sign-ins at once: try again in a second")
    finally:
        for _ in range(sum(held)):
            checks.release()
    page.fill("#password", ADMIN_PASSWORD)
    page.click("#sign-in")
    expect(page).to_have_url(url + "/jobs/new")  # where the user was going, after two errors
    expect(page.locator("#user-name")).to_have_text("admin (admin)")


def test_the_new_job_form_lists_runnable_scripts_first_and_says_every_error(browser_page: Page, service,
                                                                           workspace, tmp_path):
    page, url = browser_page, service.url
    (workspace / "gone.py").write_text("if __name__ == '__main__':\n    pass\n")
    sign_in(page, url)
    page.goto(url + "/jobs/new")
    expect(page.locator("#job-scripts option")).to_have_text(["paced_job.py", "scale_job.py"])  # run_task first
    expect(page.locator("#script-scripts option")).to_have_text(["crash.py", "gone.py"])  # then __main__ blocks
    expect(page.locator("#module-scripts option")).to_have_text(["lib/helpers.py"])
    page.fill("#script-filter", "scale")
    expect(page.locator("#script-count")).to_have_text("1 of 5 match")
    expect(page.locator("#script")).to_have_value("scale_job.py")  # the first match, chosen
    expect(page.locator("#script option:not([hidden])[value$='.py']")).to_have_count(1)
    page.fill("#script-filter", "")
    expect(page.locator("#script option:not([hidden])[value$='.py']")).to_have_count(5)

    def refused(status: int, message: str) -> None:
        assert click_for(page, "#create", "/jobs/new") == status
        expect(page.locator("#form-error")).to_contain_text(message)

    page.select_option("#script", "paced_job.py")
    page.select_option("#mode", "sync")
    page.fill("#workers", "2")
    page.fill("#replicas", "3")
    refused(400, "replicas to aggregate (3) is more than the workers (2)")
    expect(page.locator("#workers")).to_have_value("2")  # the form keeps what was typed
    page.select_option("#mode", "async")
    page.fill("#replicas", "2")
    refused(400, "replicas to aggregate is for synchronous training")
    page.fill("#replicas", "")
    page.fill("#towers", "2")
    refused(400, "towers: paced_job.py has no --towers flag")
    page.fill("#towers", "")
    page.fill("#gpus", "1000")
    refused(400, "needs 2000 GPU(s); this machine has")
    page.fill("#gpus", "0")
    page.fill("#args", "--x 'open")
    refused(400, "args: No closing quotation")
    page.fill("#args", "")
    page.fill("#env", "JUSTANAME")
    refused(400, "env line 1 'JUSTANAME' must be NAME=VALUE")
    page.fill("#env", "")
    page.select_option("#script", "gone.py")
    (workspace / "gone.py").unlink()  # deleted while the form was open
    refused(400, "script 'gone.py' is not a Python file of the workspace")

    # Job files: every one that cannot be read says why on the form.
    def imported(name: str, text: str | None, status: int, message: str | None = None) -> None:
        if text is not None:
            (tmp_path / name).write_text(text)
            page.set_input_files("#job-file", str(tmp_path / name))
        assert click_for(page, "#import", "/jobs/new") == status
        if message is not None:
            expect(page.locator("#form-error")).to_contain_text(message)

    imported("", None, 400, "choose a job file (.yaml, .yml or .toml) to import")
    imported("job.json", '{"script": "paced_job.py"}', 400, "job file 'job.json' must end in .yaml, .yml or .toml")
    imported("bad.yaml", "script: [paced_job.py\n", 400, "job file 'bad.yaml' is not valid YAML")
    imported("bad.toml", 'script = "paced_job.py"\nwokers = 3\n', 400,
             "unknown field(s) wokers (did you mean workers?); valid fields:")
    imported("noscript.yaml", "workers: 3\n", 400, "job file 'noscript.yaml' names no script")
    imported("outside.yaml", "script: ../outside.py\n", 400, "is outside the workspace")
    imported("sync.yaml", "script: paced_job.py\nmode: semi\n", 400, "mode 'semi' is not valid")

    # The README's job file: taken, what the service sets itself named on the form, nothing dropped silently.
    imported("job.yaml", "script: paced_job.py\nargs: [--last_step, 2000]\nps: 1\nworkers: 3\nmode: sync\n"
                         "restart: never\nmax_restarts: 1\nrestart_backoff: 2.5\nlogdir: runs/mnist\n"
                         "dashboard: 8080\nenv: {OMP_NUM_THREADS: \"1\"}\n", 200)
    expect(page.locator("#form-error")).to_have_count(0)
    for field, value in (("#script", "paced_job.py"), ("#args", "--last_step 2000"), ("#workers", "3"),
                         ("#mode", "sync"), ("#restart", "never"), ("#max-restarts", "1"),
                         ("#restart-backoff", "2.5"), ("#env", "OMP_NUM_THREADS=1")):
        expect(page.locator(field)).to_have_value(value)
    expect(page.locator("#form-notice")).to_have_text(
        "dashboard is not used by the service: the job's page shows the job's dashboard\n"
        "logdir is not used by the service: the service gives every job its own folder (the job's page names it, "
        "for TensorBoard)")
    imported("odd.yaml", 'script: paced_job.py\nenv: {GREETING: "two\\nlines", A: "1"}\n', 200)
    expect(page.locator("#form-notice")).to_have_text(
        "env (GREETING) from odd.yaml cannot be shown in this form: submit the file with "
        "'tensorfleet jobs submit odd.yaml' to keep them")
    expect(page.locator("#env")).to_have_value("A=1")
    assert service.client().call("GET", "/api/jobs")["jobs"] == []

    # A clone's form says the same of what it cannot show, and proposes a name of its own.
    job = service.client().call("POST", "/api/jobs", {"script": "paced_job.py", "name": "odd", "workers": 1,
                                                      "args": ["--last_step", "1"], "env": {"GREETING": "a\nb"}})
    page.goto(f"{url}/jobs/new?from={job['id']}")
    expect(page.locator("#name")).to_have_value("odd-copy")
    expect(page.locator("#form-notice")).to_have_text(
        f"env (GREETING) from job {job['id']} cannot be shown in this form: clone it through the API "
        f"(POST /api/jobs/{job['id']}/clone) to keep them")
    page.goto(f"{url}/jobs/new?from=999")
    expect(page.locator("#action-error")).to_have_text("no job 999")


def test_the_job_pages_buttons_say_what_went_wrong(browser_page: Page, service):
    page, url, api = browser_page, service.url, service.client()
    job = api.call("POST", "/api/jobs", {"script": "paced_job.py", "args": SLOW, "workers": 1, "mode": "async"})["id"]
    sign_in(page, url)
    page.goto(f"{url}/jobs/{job}")
    expect(page.locator("#job-state")).to_have_text("running", timeout=60_000)

    # Scale to a number the browser would refuse (min=1), sent all the same: the page says why, status 400.
    page.eval_on_selector("#scale-workers", "input => input.removeAttribute('min')")
    page.fill("#scale-workers", "0")
    assert click_for(page, "#scale", f"/jobs/{job}/scale") == 400
    expect(page.locator("#action-error")).to_have_text("workers must be an integer of at least 1, got 0")
    expect(page).to_have_url(f"{url}/jobs/{job}/scale")
    csrf = page.locator('meta[name="csrf-token"]').get_attribute("content")
    answer = page.request.post(f"{url}/jobs/{job}/scale", form={"csrf": csrf, "workers": "two"})
    assert answer.status == 400 and "workers must be a whole number, got &#39;two&#39;" in answer.text()

    # Restart of a running job asks first: a second run beside it, or stop it and run again.
    page.goto(f"{url}/jobs/{job}")
    expect(page.locator("#restart")).to_have_text("Restart…")
    assert click_for(page, "#restart", f"/jobs/{job}/restart") == 200
    expect(page.locator("#restart-confirm")).to_contain_text(f"Job #{job} is still running")
    assert api.call("GET", "/api/jobs")["jobs"][0]["id"] == job  # nothing started by the question
    page.click("#restart-beside")
    expect(page).to_have_url(f"{url}/jobs/{job + 1}")
    assert service.job(job)["stop_requested"] is None
    page.goto(f"{url}/jobs/{job}")
    page.click("#restart")
    page.click("#restart-after-stop")
    expect(page).to_have_url(f"{url}/jobs/{job + 2}")
    assert service.job(job)["stop_requested"] == "admin"
    poll(lambda: service.job(job)["finished_at"], 60, f"job {job} to stop", interval_s=0.2)

    # A finished job cannot be stopped; a job that is not there is a 404; both said on a page.
    page.goto(f"{url}/jobs/{job}")
    answer = page.request.post(f"{url}/jobs/{job}/stop", form={"csrf": csrf})
    assert answer.status == 409 and "has already finished (stopped): nothing to stop" in answer.text()
    answer = page.request.post(f"{url}/jobs/999/stop", form={"csrf": csrf})
    assert answer.status == 404 and "no job 999" in answer.text()

    # Another user sees no buttons but Clone, and what they send anyway is refused with the reason.
    service.service.accounts.add_user("bob", "bob-password")
    other = page.context.browser.new_context()
    try:
        bob = other.new_page()
        sign_in(bob, url, "bob", "bob-password")
        bob.goto(f"{url}/jobs/{job + 2}")
        expect(bob.locator("#clone")).to_be_visible()
        expect(bob.locator("#stop, #restart, #scale")).to_have_count(0)
        bob_csrf = bob.locator('meta[name="csrf-token"]').get_attribute("content")
        for action, form in (("stop", {}), ("scale", {"workers": "2"}), ("restart", {"then": "stop"})):
            answer = bob.request.post(f"{url}/jobs/{job + 2}/{action}", form={"csrf": bob_csrf, **form})
            assert answer.status == 403, action
            assert f"job {job + 2} belongs to admin: only they or an admin can change it" in answer.text()
        assert service.job(job + 2)["stop_requested"] is None and service.job(job + 2)["workers_target"] is None
    finally:
        other.close()
    for other_job in (job + 1, job + 2):
        api.call("POST", f"/api/jobs/{other_job}/stop", {})
        poll(lambda: service.job(other_job)["finished_at"], 60, f"job {other_job} to stop", interval_s=0.2)


def test_a_failed_job_shows_its_error_line_first_and_the_traceback_below(browser_page: Page, service):
    page, url = browser_page, service.url
    job = service.client().call("POST", "/api/jobs", {"script": "crash.py", "workers": 1})["id"]
    sign_in(page, url)
    page.goto(f"{url}/jobs/{job}")
    expect(page.locator("#job-state")).to_have_text("failed", timeout=60_000)
    error, reason, traceback = (page.locator(f"#job-{part}") for part in ("error-line", "reason", "traceback"))
    expect(error).to_have_text("RuntimeError: the model does not fit: on purpose")
    expect(reason).to_contain_text("not restarted because")
    expect(traceback).to_contain_text(re.compile(r"^Traceback \(most recent call last\)"))
    tops = [part.bounding_box()["y"] for part in (error, reason, traceback)]
    assert tops == sorted(tops), tops


def test_a_job_its_parser_refused_shows_the_parsers_line_and_the_form_leaves_the_mode_to_the_script(
        browser_page: Page, service, workspace):
    """``/jobs`` is the list; the new-job form sends no mode unless one is chosen; a job whose script's argument
    parser refused its flags shows the parser's line first, its usage below."""
    page, url = browser_page, service.url
    (workspace / "flags.py").write_text("import argparse\nimport tensorfleet\n\nparser = argparse.ArgumentParser()\n"
                                        "parser.add_argument('--steps', type=int)\nparser.parse_args()\n")
    sign_in(page, url)
    page.goto(url + "/jobs")
    expect(page).to_have_url(url + "/")
    page.click("#new-job-link")
    expect(page.locator("#mode")).to_have_value("")
    expect(page.locator("#mode option:checked")).to_have_text("as the script defaults")
    page.select_option("#script", "flags.py")
    page.fill("#args", "--bogus")
    page.fill("#workers", "1")
    page.click("#create")
    expect(page.locator("#job-state")).to_have_text("failed", timeout=60_000)
    expect(page.locator("#job-error-line")).to_have_text("flags.py: error: unrecognized arguments: --bogus")
    expect(page.locator("#job-traceback")).to_contain_text(re.compile(r"^usage: flags.py \[-h\]"))
    expect(page.locator("dl.facts")).to_contain_text("mode as the script defaults")


def test_the_job_page_follows_a_scale_without_a_reload(browser_page: Page, service, tmp_path):
    page, url, api = browser_page, service.url, service.client()
    last_step = tmp_path / "last_step"
    job = api.call("POST", "/api/jobs", {"script": "scale_job.py", "workers": 2, "mode": "async",
                                         "args": ["--last_step_file", str(last_step)]})["id"]
    sign_in(page, url)
    page.goto(f"{url}/jobs/{job}")
    expect(page.locator("#task-rows tr")).to_have_count(3, timeout=60_000)
    poll(lambda: service.job(job)["progress"]["global_step"], 90, "training to start", interval_s=0.2)
    page.fill("#scale-workers", "3")
    page.click("#scale")
    expect(page).to_have_url(f"{url}/jobs/{job}")
    page.evaluate("window.notReloaded = true")  # gone if the page loads again
    expect(page.locator('#task-rows tr[data-task="worker:2"]')).to_be_visible(timeout=90_000)
    expect(page.locator('#log-tabs button[data-task="worker:2"]')).to_have_text("worker:2")
    poll(lambda: "worker:2 starts at global step" in api.call("GET", f"/api/jobs/{job}/logs/worker:2")["text"],
         90, "worker:2 to join before it is scaled away", interval_s=0.2)

    api.call("POST", f"/api/jobs/{job}/scale", {"workers": 1})
    for name in ("worker:1", "worker:2"):
        expect(page.locator(f'#task-rows tr[data-task="{name}"] td[data-field="state"]')).to_have_text(
            "removed", timeout=90_000)
        expect(page.locator(f'#log-tabs button[data-task="{name}"]')).to_have_text(f"{name} (removed)")
    page.click('#log-tabs button[data-task="worker:2"]')
    expect(page.locator("#log")).to_contain_text("worker:2 starts at global step")
    assert page.evaluate("window.notReloaded") is True
    last_step.write_text("1")
    expect(page.locator("#job-state")).to_have_text("succeeded", timeout=90_000)
