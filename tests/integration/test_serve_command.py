"""``tensorfleet serve`` as a user runs it: first start, a job, the service SIGKILLed while the job runs, a new
service that finds the job again; relative folders; and the flags and ports it refuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.cli.service import Client
from tensorfleet.service.local import is_runner
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import stop_runners

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"


def serve(home: Path | str, workspace: Path | str, *flags: str, password: str | None = "first-password",
          cwd: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TENSORFLEET_ADMIN_PASSWORD"}
    if password is not None:
        env["TENSORFLEET_ADMIN_PASSWORD"] = password
    return subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", "serve", "--home", str(home),
                             "--workspace", str(workspace), "--port", "0", *flags], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)


def client_of(home: Path, process: subprocess.Popen) -> Client:
    def started() -> dict | None:
        assert process.poll() is None, process.stdout.read()
        try:
            found = json.loads((home / "service.json").read_text())
        except (OSError, ValueError):
            return None
        return found if found["pid"] == process.pid else None

    url = poll(started, 60, "the service to start", interval_s=0.1)["url"]
    return Client(url, (home / "cli-token").read_text().strip())


def test_a_killed_service_leaves_its_job_running_and_a_new_one_finds_it(tmp_path):
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    shutil.copy(PACED, workspace / "paced_job.py")
    first = serve(home, workspace)
    second = None
    try:
        api = client_of(home, first)
        assert oct((home / "cli-token").stat().st_mode & 0o777) == "0o600"
        job = api.call("POST", "/api/jobs", {"script": "paced_job.py", "args": ["--last_step", "100000"],
                                             "workers": 2, "mode": "async"})
        poll(lambda: api.call("GET", f"/api/jobs/{job['id']}")["progress"]["global_step"], 90, "training to start",
             interval_s=0.2)
        runner = api.call("GET", f"/api/jobs/{job['id']}")["pid"]
        first.kill()
        first.wait(10)
        assert is_runner(runner, home / "jobs.sqlite", job["id"])  # the job did not die with the service

        second = serve(home, workspace, password=None)  # not the first start: no password needed
        api = client_of(home, second)
        found = api.call("GET", f"/api/jobs/{job['id']}")
        assert found["state"] == "running" and found["pid"] == runner
        step = found["progress"]["global_step"]
        poll(lambda: api.call("GET", f"/api/jobs/{job['id']}")["progress"]["global_step"] > step, 30,
             "the re-attached job to keep training", interval_s=0.2)
        api.call("POST", f"/api/jobs/{job['id']}/stop", {})
        stopped = poll(lambda: (j := api.call("GET", f"/api/jobs/{job['id']}"))["finished_at"] and j, 60,
                       "the job to stop", interval_s=0.2)
        assert stopped["state"] == "stopped"
        second.send_signal(signal.SIGTERM)
        output, _ = second.communicate(timeout=30)
        assert second.returncode == 0 and "running jobs keep running" in output
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        stop_runners(home)


def test_the_first_start_without_a_password_prints_one_and_a_public_host_needs_tls(tmp_path):
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    first = serve(home, workspace, password=None)
    try:
        api = client_of(home, first)
        assert api.call("GET", "/api/whoami") == {"user": "admin", "admin": True}
    finally:
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=30)
    assert "created the user 'admin' with the password" in output

    refused = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "serve", "--home", str(home),
                              "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "would send passwords and tokens in clear" in refused.stderr and "--tls-cert" in refused.stderr


def test_a_relative_home_and_workspace_are_where_serve_was_started(tmp_path):
    (tmp_path / "ws").mkdir()
    shutil.copy(PACED, tmp_path / "ws" / "paced_job.py")
    home = tmp_path / "home"
    process = serve("home", "ws", cwd=tmp_path)  # both relative to the folder serve starts in
    try:
        api = client_of(home, process)
        job = api.call("POST", "/api/jobs", {"script": "paced_job.py", "workers": 1, "mode": "async",
                                             "args": ["--last_step", "50", "--step_sleep_s", "0.01"]})
        done = poll(lambda: (j := api.call("GET", f"/api/jobs/{job['id']}"))["finished_at"] and j, 90,
                    "the job to finish", interval_s=0.2)
        assert done["state"] == "succeeded", done["reason"]
        assert done["logdir"] == str(home / "jobs" / str(job["id"]))
        listed = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "users", "ls", "--home", "home"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and listed.stdout.split() == ["admin", "admin"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        stop_runners(home)


def test_a_taken_port_fails_before_the_home_and_the_admin_are_made(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "TENSORFLEET_ADMIN_PASSWORD"}
        refused = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "serve", "--home",
                                  str(tmp_path / "new-home"), "--workspace", str(tmp_path), "--port", str(port)],
                                 env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in refused.stderr and "choose another --port" in refused.stderr
    assert "password" not in refused.stdout + refused.stderr  # no admin password shown for a service that never ran
    assert not (tmp_path / "new-home").exists()
