"""The job service over HTTP with real jobs: run, stop, queue, re-attach after a restart, fail with the
reason, and refuse what it must (no session, no CSRF token, scripts outside the workspace, too big)."""

from __future__ import annotations

import http.client
import http.cookiejar
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from tensorfleet.errors import TensorfleetError
from tensorfleet.service.local import is_runner
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import ADMIN_PASSWORD, running_service, start_service, stop_runners

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"
FAST = ["--last_step", "150", "--step_sleep_s", "0.01"]
SLOW = ["--last_step", "100000", "--step_sleep_s", "0.02"]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "workspace"
    folder.mkdir()
    shutil.copy(PACED, folder / "paced_job.py")
    (folder / "crash.py").write_text("import tensorfleet\nraise RuntimeError('the model does not fit: on purpose')\n")
    return folder


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def job_fields(args: list[str], **more) -> dict:
    return {"script": "paced_job.py", "args": args, "ps": 1, "workers": 2, "mode": "async", **more}


def wait_state(under_test, job_id: int, states: set[str], timeout_s: float = 90) -> dict:
    return poll(lambda: (job := under_test.job(job_id))["state"] in states and job, timeout_s,
                f"job {job_id} to be {' or '.join(sorted(states))}", interval_s=0.2)


def task_pids(home: Path, job_id: int) -> list[int]:
    try:
        picture = json.loads((home / "jobs" / str(job_id) / "picture.json").read_text())
    except FileNotFoundError:  # the runner writes it once a second
        return []
    return [t["pid"] for t in picture["tasks"] if t.get("pid")]


def gone(pids: list[int]) -> bool:
    """Whether every one of ``pids`` has exited (a zombie counts: it only waits to be reaped)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_a_job_runs_to_success_with_its_logs_tasks_history_and_dashboard(home, workspace):
    with running_service(home, workspace) as service:
        api = service.client()
        job = api.call("POST", "/api/jobs", job_fields(FAST))
        assert job["state"] == "queued" and job["owner"] == "admin"
        done = wait_state(service, job["id"], {"succeeded", "failed", "lost"})
        assert done["state"] == "succeeded", done["reason"]
        assert done["progress"]["global_step"] >= 150
        accuracy = done["metrics"]["accuracy"]  # what the script reported at its end (tfl.report_metrics)
        assert 0.50015 <= accuracy <= 0.5 + done["progress"]["global_step"] / 1e6  # at the chief's last step
        browser = signed_in_browser(service.url)
        shown = f"accuracy {accuracy:.4f}"
        assert shown in browser.open(service.url + "/").read().decode()  # the jobs list
        assert re.search(rf'id="job-metrics">{shown}<', browser.open(f"{service.url}/jobs/{job['id']}").read().decode())
        log = api.call("GET", f"/api/jobs/{job['id']}/logs/worker:0")
        assert "worker:0 done at global step" in log["text"]
        rest = api.call("GET", f"/api/jobs/{job['id']}/logs/worker:0?offset={log['next_offset']}")
        assert rest["text"] == ""
        tasks = api.call("GET", f"/api/jobs/{job['id']}/tasks")["tasks"]
        assert [t["name"] for t in tasks] == ["ps:0", "worker:0", "worker:1"]
        assert all("TF_CONFIG" in t["env"] and "TENSORFLEET_TOKEN" not in t["env"] for t in tasks)
        kinds = [e["text"] for e in api.call("GET", f"/api/jobs/{job['id']}/events")["events"]]
        assert kinds[-1] == "running -> succeeded: every worker finished"
        with pytest.raises(TensorfleetError, match="no task 'worker:7'"):
            api.call("GET", f"/api/jobs/{job['id']}/logs/worker:7")


def test_stopping_a_running_job_ends_every_process_and_records_who(home, workspace):
    with running_service(home, workspace) as service:
        api = service.client()
        job_id = api.call("POST", "/api/jobs", job_fields(SLOW))["id"]
        wait_state(service, job_id, {"running"})
        pids = poll(lambda: len(task_pids(home, job_id)) == 3 and task_pids(home, job_id), 60, "three task pids")
        runner = service.job(job_id)["pid"]
        api.call("POST", f"/api/jobs/{job_id}/stop", {})
        stopped = wait_state(service, job_id, {"stopped", "failed", "lost"}, 60)
        assert stopped["state"] == "stopped" and stopped["reason"] == "stopped by admin"
        poll(lambda: gone(pids + [runner]), 30, "every task and the runner to exit")


def test_a_restarted_service_reattaches_to_running_jobs_and_marks_a_dead_runner_lost(home, workspace):
    try:
        first = start_service(home, workspace, slots=16)
        api = first.client()
        kept, killed = (api.call("POST", "/api/jobs", job_fields(SLOW))["id"] for _ in range(2))
        for job_id in (kept, killed):
            wait_state(first, job_id, {"running"})
        killed_runner = first.job(killed)["pid"]
        orphans = poll(lambda: len(task_pids(home, killed)) == 3 and task_pids(home, killed), 60, "three task pids")
        first.service.close()
        first.service.store.close()  # the service is gone; its jobs are not

        os.kill(killed_runner, signal.SIGKILL)
        poll(lambda: not is_runner(killed_runner, home / "jobs.sqlite", killed), 10, "the runner to die")
        poll(lambda: gone(orphans), 30, "the killed runner's tasks to die with it (parent-death signal)")
        second = start_service(home, workspace, slots=16)
        try:
            again = second.job(kept)
            assert again["state"] == "running" and again["pid"] is not None
            events = [e["kind"] for e in second.client().call("GET", f"/api/jobs/{kept}/events")["events"]]
            assert events.count("re-attached") == 1 and events.count("state") == 2  # never started twice
            lost = second.job(killed)
            assert lost["state"] == "lost" and f"pid {killed_runner}" in lost["reason"]
            second.client().call("POST", f"/api/jobs/{kept}/stop", {})
            final = wait_state(second, kept, {"stopped", "failed", "lost"}, 60)
            assert final["state"] == "stopped", final["reason"]
        finally:
            second.service.close()
            second.service.store.close()
    finally:
        stop_runners(home)


def test_queued_jobs_start_first_come_first_served_when_the_cores_free_up(home, workspace):
    with running_service(home, workspace, slots=4) as service:
        api = service.client()
        first = api.call("POST", "/api/jobs", job_fields(["--last_step", "300", "--step_sleep_s", "0.01"]))["id"]
        second = api.call("POST", "/api/jobs", job_fields(FAST))["id"]
        wait_state(service, first, {"running"})
        assert service.job(second)["state"] == "queued"  # 3 + 3 tasks > 4 slots
        assert wait_state(service, first, {"succeeded", "failed"})["state"] == "succeeded"
        assert wait_state(service, second, {"succeeded", "failed"})["state"] == "succeeded"
        assert service.job(second)["started_at"] >= service.job(first)["finished_at"]


def test_a_task_that_keeps_crashing_fails_the_job_with_its_traceback_once(home, workspace):
    with running_service(home, workspace) as service:
        job_id = service.client().call("POST", "/api/jobs", {"script": "crash.py", "workers": 1})["id"]
        failed = wait_state(service, job_id, {"succeeded", "failed", "lost"}, 60)
        assert failed["state"] == "failed"
        assert failed["reason"].count("Traceback (most recent call last)") == 1
        assert "RuntimeError: the model does not fit: on purpose" in failed["reason"]
        assert "not restarted because" in failed["reason"]


def test_what_the_service_refuses(home, workspace, tmp_path):
    (tmp_path / "outside.py").write_text("print('not in the workspace')\n")
    (workspace / "link.py").symlink_to(tmp_path / "outside.py")
    with running_service(home, workspace) as service:
        url, api = service.url, service.client()
        with pytest.raises(TensorfleetError, match="sign in first"):
            service.client("tfs_not-a-token").call("GET", "/api/jobs")
        for script in ("../outside.py", str(tmp_path / "outside.py"), "link.py"):
            with pytest.raises(TensorfleetError, match="outside the workspace"):
                api.call("POST", "/api/jobs", {"script": script})
        with pytest.raises(TensorfleetError, match="not a Python file of the workspace"):
            api.call("POST", "/api/jobs", {"script": "missing.py"})
        with pytest.raises(TensorfleetError, match="unknown setting\\(s\\) wokers; valid: args, coordinator, dense, env, gpus_per_worker"):
            api.call("POST", "/api/jobs", {"script": "paced_job.py", "wokers": 2})
        with pytest.raises(TensorfleetError, match="job file 'job.json' must end in .yaml, .yml or .toml"):
            api.call("POST", "/api/jobs", {"job_file": {"name": "job.json", "text": "script: paced_job.py"}})
        with pytest.raises(TensorfleetError, match="job_file must be"):
            api.call("POST", "/api/jobs", {"job_file": "script: paced_job.py"})
        with pytest.raises(TensorfleetError, match="workers must be at least 1"):
            api.call("POST", "/api/jobs", {"script": "paced_job.py", "workers": 0})
        assert api.call("GET", "/api/jobs")["jobs"] == []  # nothing stored

        # A browser session: a POST without the CSRF token changes nothing.
        job_id = api.call("POST", "/api/jobs", job_fields(SLOW))["id"]
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        browser.open(url + "/login", urllib.parse.urlencode({"user": "admin", "password": ADMIN_PASSWORD}).encode())
        assert any(c.name == "tensorfleet_session" for c in jar)
        with pytest.raises(urllib.error.HTTPError) as refused:
            browser.open(urllib.request.Request(url + f"/jobs/{job_id}/stop", data=b"x=1", method="POST"))
        assert refused.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as refused:
            browser.open(urllib.request.Request(url + f"/api/jobs/{job_id}/stop", data=b"{}", method="POST",
                                                headers={"Content-Type": "application/json"}))
        assert refused.value.code == 403
        assert service.job(job_id)["stop_requested"] is None

        # Another user may look, not touch.
        service.service.accounts.add_user("bob", "bob-password")
        bob = service.client(service.service.accounts.new_api_token("bob"))
        assert [j["id"] for j in bob.call("GET", "/api/jobs")["jobs"]] == [job_id]
        with pytest.raises(TensorfleetError, match="belongs to admin"):
            bob.call("POST", f"/api/jobs/{job_id}/stop", {})

        # Bounded bodies, safe redirects.
        address = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.putrequest("POST", "/api/jobs")
        connection.putheader("Content-Length", str(2 << 20))  # announced, never sent: refused before reading
        connection.endheaders()
        assert connection.getresponse().status == 413
        connection.close()
        page = browser.open(url + "/login?next=//evil.example/").read().decode()
        assert 'name="next" value="/"' in page
        api.call("POST", f"/api/jobs/{job_id}/stop", {})
        wait_state(service, job_id, {"stopped"}, 60)


def test_a_full_disk_is_a_clear_error_not_a_500(home, workspace):
    with running_service(home, workspace) as service:
        store = service.service.store
        with store.read() as conn:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(TensorfleetError, match="could not save it: database or disk is full"):
            for _ in range(200):  # fills the last free pages, then fails
                service.client().call("POST", "/api/jobs", job_fields(FAST, name="filler-" + "x" * 200))
        with store.read() as conn:
            conn.execute("PRAGMA max_page_count = 1073741823")
        assert all(j["state"] in ("queued", "running", "starting") for j in service.client().call(
            "GET", "/api/jobs")["jobs"])
        for job in service.client().call("GET", "/api/jobs")["jobs"]:
            service.client().call("POST", f"/api/jobs/{job['id']}/stop", {})


def test_the_jobs_command_submits_lists_follows_and_stops(home, workspace, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"script: {workspace / 'paced_job.py'}\nargs: [--last_step, '150']\nworkers: 2\n"
                        f"mode: async\n")
    with running_service(home, workspace) as service:
        def tensorfleet(*argv: str) -> str:
            done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", *argv, "--url", service.url,
                                   "--token", service.token], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            return done.stdout

        out = tensorfleet("jobs", "submit", str(job_file), "--name", "from-cli")
        assert out.startswith("job 1 (from-cli) queued")
        logs = tensorfleet("jobs", "logs", "1", "worker:1", "--follow")
        assert "worker:1 done at global step" in logs
        assert "succeeded" in tensorfleet("jobs", "ls", "--state", "succeeded")
        restarted = tensorfleet("jobs", "restart", "1")
        assert "restarted as job 2" in restarted and "second run" not in restarted  # job 1 had finished
        wait_state(service, 2, {"running", "succeeded"})
        tensorfleet("jobs", "stop", "2")
        assert wait_state(service, 2, {"stopped", "succeeded", "failed"})["state"] in ("stopped", "succeeded")
        slow = service.client().call("POST", "/api/jobs", job_fields(SLOW))["id"]
        wait_state(service, slow, {"running"})
        again = tensorfleet("jobs", "restart", str(slow))
        assert (f"job {slow} is still running: job {slow + 1} is a second run beside it (stop the first with "
                f"'tensorfleet jobs stop {slow}')") in again
        for job_id in (slow, slow + 1):
            tensorfleet("jobs", "stop", str(job_id))
            wait_state(service, job_id, {"stopped", "failed"}, 60)
        bad = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "ls", "--url", service.url,
                              "--token", "wrong"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "sign in first" in bad.stderr


def test_a_running_async_job_is_scaled_up_and_down_from_the_api(home):
    repo = PACED.parents[2]
    with running_service(home, repo) as service:
        api = service.client()
        job_id = api.call("POST", "/api/jobs", {"script": "examples/mnist_mlp.py", "workers": 2, "mode": "async",
                                                "args": ["--train_steps", "1000000", "--log_every", "200"]})["id"]
        poll(lambda: service.job(job_id)["progress"]["global_step"], 90, "training to start", interval_s=0.2)
        api.call("POST", f"/api/jobs/{job_id}/scale", {"workers": 3})

        def worker_running(name: str) -> bool:
            picture = json.loads((home / "jobs" / str(job_id) / "picture.json").read_text())
            return any(t["name"] == name and t["state"] == "running" for t in picture["tasks"])

        poll(lambda: worker_running("worker:2"), 90, "worker:2 to join", interval_s=0.2)
        assert [t["name"] for t in api.call("GET", f"/api/jobs/{job_id}/tasks")["tasks"]] == [
            "ps:0", "worker:0", "worker:1", "worker:2"]
        poll(lambda: "training begins" in api.call("GET", f"/api/jobs/{job_id}/logs/worker:2")["text"], 120,
             "worker:2 to train")

        api.call("POST", f"/api/jobs/{job_id}/scale", {"workers": 1})
        launcher_log = lambda: api.call("GET", f"/api/jobs/{job_id}/logs/launcher")["text"]  # noqa: E731
        poll(lambda: "worker:1 left the job (exit code 0)" in launcher_log()
             and "worker:2 left the job (exit code 0)" in launcher_log(), 90, "workers 1 and 2 to leave")
        assert service.job(job_id)["state"] == "running"
        # The workers scaled away stay tasks of the job, listed removed, their logs readable (API and CLI).
        removed = poll(lambda: [t["name"] for t in api.call("GET", f"/api/jobs/{job_id}/tasks")["tasks"]
                                if t["state"] == "removed"] == ["worker:1", "worker:2"], 30, "removed workers")
        assert removed
        assert "training begins" in api.call("GET", f"/api/jobs/{job_id}/logs/worker:2")["text"]
        printed = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "logs", str(job_id),
                                  "worker:2", "--url", service.url, "--token", service.token],
                                 capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0 and "training begins" in printed.stdout, printed.stderr
        texts = [e["text"] for e in api.call("GET", f"/api/jobs/{job_id}/events")["events"]]
        assert "admin asked for 3 worker(s)" in texts and "now 1 worker(s)" in texts
        api.call("POST", f"/api/jobs/{job_id}/stop", {})
        assert wait_state(service, job_id, {"stopped", "failed"}, 60)["state"] == "stopped"

        sync = api.call("POST", "/api/jobs",
                        job_fields(SLOW, mode="sync", script="tests/integration/paced_job.py"))["id"]
        wait_state(service, sync, {"running"})
        with pytest.raises(TensorfleetError, match="only an asynchronous job can be scaled"):
            api.call("POST", f"/api/jobs/{sync}/scale", {"workers": 3})
        api.call("POST", f"/api/jobs/{sync}/stop", {})
        wait_state(service, sync, {"stopped"}, 60)


def test_a_job_stopped_while_its_runner_still_starts_is_stopped_not_lost(home, workspace):
    with running_service(home, workspace) as service:
        api = service.client()
        for _ in range(3):  # the runner imports for a moment after the service records it running
            job_id = api.call("POST", "/api/jobs", job_fields(SLOW))["id"]
            poll(lambda: service.job(job_id)["state"] == "running", 60, "the job to be running", interval_s=0.01)
            api.call("POST", f"/api/jobs/{job_id}/stop", {})
            stopped = wait_state(service, job_id, {"stopped", "failed", "lost", "succeeded"}, 60)
            assert stopped["state"] == "stopped", stopped["reason"]


README_JOB_FILE = """script: examples/mnist_mlp.py
args: [--last_step, 100000]
ps: 1
workers: 2
mode: async             # or sync
restart: on-failure     # or never
max_restarts: 3
logdir: runs/mnist
dashboard: 8080         # optional
env: {OMP_NUM_THREADS: "1"}
"""


def test_a_job_file_is_taken_by_one_rule_from_the_cli_and_the_api(home, workspace, tmp_path):
    (workspace / "examples").mkdir()
    shutil.copy(PACED, workspace / "examples" / "mnist_mlp.py")
    job_file = tmp_path / "elsewhere" / "job.yaml"  # not in the workspace: its script is a path in the workspace
    job_file.parent.mkdir()
    job_file.write_text(README_JOB_FILE)
    with running_service(home, workspace) as service:
        api = service.client()
        done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "submit", str(job_file),
                               "--url", service.url, "--token", service.token], cwd=tmp_path / "elsewhere",
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("job 1 (mnist-mlp) queued")
        assert lines[1:] == [f"note: dashboard in {job_file} is not used by the service: the job's page shows the "
                             f"job's dashboard",
                             f"note: logdir in {job_file} is not used by the service: the service gives every job "
                             f"its own folder (the job's page names it, for TensorBoard)"]
        job = api.call("POST", "/api/jobs", {"job_file": {"name": "job.yaml", "text": README_JOB_FILE},
                                             "name": "from-the-api"})
        assert (job["name"], sorted(job["ignored"])) == ("from-the-api", ["dashboard", "logdir"])
        for job_id in (1, job["id"]):
            config = service.job(job_id)["config"]
            assert (config["script"], config["logdir"], config["dashboard"], config["env"]) == (
                str(workspace / "examples" / "mnist_mlp.py"), None, None, {"OMP_NUM_THREADS": "1"})
            events = api.call("GET", f"/api/jobs/{job_id}/events")["events"]
            assert [e["text"].splitlines()[0] for e in events if e["kind"] == "ignored"] == [
                "dashboard is not used by the service: the job's page shows the job's dashboard"]
            api.call("POST", f"/api/jobs/{job_id}/stop", {})
        missing = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "submit",
                                  str(tmp_path / "nothing.yaml"), "--url", service.url, "--token", service.token],
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2 and "cannot be read: No such file or directory" in missing.stderr
        for job_id in (1, job["id"]):
            wait_state(service, job_id, {"stopped", "failed", "succeeded"}, 60)


def signed_in_browser(url: str) -> urllib.request.OpenerDirector:
    """A browser's session: signed in as admin with a cookie, following redirects."""
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    browser.open(url + "/login", urllib.parse.urlencode({"user": "admin", "password": ADMIN_PASSWORD}).encode())
    return browser


def csrf_of(page: str) -> str:
    return page.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]


def test_the_new_job_forms_default_mode_is_the_scripts_own(home, workspace):
    """The form sends no mode unless one is chosen: a script that is sync by default runs sync from it, as under
    'tensorfleet launch' without --sync or --async."""
    with running_service(home, workspace) as service:
        browser = signed_in_browser(service.url)
        form = browser.open(service.url + "/jobs/new").read().decode()
        mode = form.split('<select name="mode" id="mode">', 1)[1].split("</select>", 1)[0]
        assert re.search(r'<option value="" selected>as the script defaults</option>', mode), mode
        assert "selected" not in mode.replace('<option value="" selected>', "")
        fields = {"csrf": csrf_of(form), "script": "paced_job.py", "args": " ".join(FAST), "ps": "1", "workers": "1",
                  "mode": "", "restart": "on-failure", "max_restarts": "3", "backend": "local"}
        created = browser.open(service.url + "/jobs/new", urllib.parse.urlencode(fields).encode())
        job_id = int(created.url.rsplit("/", 1)[1])
        assert service.job(job_id)["config"].get("mode") is None
        assert "mode as the script defaults" in created.read().decode()
        wait_state(service, job_id, {"succeeded", "failed", "lost"})


def test_jobs_is_the_jobs_list_and_no_page_asks_for_a_missing_favicon(home, workspace):
    with running_service(home, workspace) as service:
        url = service.url
        browser = signed_in_browser(url)
        job_id = service.client().call("POST", "/api/jobs", job_fields(FAST, workers=1))["id"]
        for path, target in (("/jobs", "/"), ("/jobs/", "/"), ("/jobs?state=queued", "/?state=queued")):
            answer = browser.open(url + path)
            assert answer.status == 200 and answer.url == url + target, path
            assert 'id="jobs"' in answer.read().decode(), path
        listed = browser.open(url + "/jobs").read().decode()
        assert f'data-job="{job_id}"' in listed
        for path in ("/", "/jobs/new", f"/jobs/{job_id}", f"/jobs/{job_id}/dashboard/", "/login"):
            assert '<link rel="icon" href="data:,">' in browser.open(url + path).read().decode(), path
        wait_state(service, job_id, {"succeeded", "failed", "lost"})


def test_a_job_its_argument_parser_refused_shows_the_parsers_line(home, workspace):
    (workspace / "flags.py").write_text("import argparse\nimport tensorfleet\n\nparser = argparse.ArgumentParser()\n"
                                        "parser.add_argument('--steps', type=int)\nparser.parse_args()\n")
    with running_service(home, workspace) as service:
        job_id = service.client().call("POST", "/api/jobs", {"script": "flags.py", "workers": 1,
                                                             "args": ["--bogus"]})["id"]
        failed = wait_state(service, job_id, {"succeeded", "failed", "lost"}, 60)
        assert failed["state"] == "failed", failed["reason"]
        assert failed["error_line"] == "flags.py: error: unrecognized arguments: --bogus", failed["reason"]
        assert failed["traceback"].startswith("usage: flags.py [-h] [--steps STEPS]")
        assert "exit code 2; not restarted" in failed["summary"]
        page = signed_in_browser(service.url).open(f"{service.url}/jobs/{job_id}").read().decode()
        assert re.search(r'id="job-error-line"\s*>flags.py: error: unrecognized arguments: --bogus</p>', page), page
