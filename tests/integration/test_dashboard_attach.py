"""``tensorfleet dashboard --cluster`` attached to a fleet it did not start: it reads every task's Status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tensorfleet.cluster.environment import STATUS_DIR_ENV
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import UnauthenticatedError
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.launch.monitor import FleetMonitor, fleet_tasks
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import REPO, LauncherProcess
from tensorfleet.wire import auth
from tensorfleet.wire.rpc import Channel, WireOptions

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"


def get_json(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def started_addresses(job: LauncherProcess, count: int) -> dict[str, str]:
    """Each task's address as the launcher says it started them, once ``count`` tasks have."""
    return poll(lambda: (lambda found: found if len(found) == count else None)(
        dict(re.findall(r"started (\w+:\d+) \(pid \d+\) at (\S+)", job.output))), 60, f"{count} tasks to start")


def test_attached_dashboard_shows_a_fleet_started_elsewhere(tmp_path):
    token = auth.new_token()  # the launcher uses the token it is given; the dashboard needs the same one
    env = {**os.environ, auth.TOKEN_ENV: token}
    stop = tmp_path / "stop"  # written once the dashboard has been checked: the job ends then, not at step 1200
    job = LauncherProcess(tmp_path / "logs", ["--ps", "1", "--workers", "2"], PACED,
                          ["--last_step", "1200", "--step_sleep_s", "0.01", "--stop_file", str(stop)], env=env)
    board = None
    try:
        addresses = started_addresses(job, 3)
        cluster = {"ps": [addresses["ps:0"]], "worker": [addresses["worker:0"], addresses["worker:1"]]}
        stranger = Channel(addresses["worker:1"], task="worker:1", options=WireOptions(token=None))
        with pytest.raises(UnauthenticatedError, match="refuses calls without the job's token"):
            stranger.call("Status", timeout=30, wait_for_ready=True)  # without the token, nothing to see
        stranger.close()
        board = subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", "dashboard", "--cluster",
                                  json.dumps(cluster), "--name", "attached"], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env)
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", board.stdout.readline()).group(1)
        picture = poll(lambda: (lambda s: s if all(t["state"] == "running" for t in s["tasks"])
                                 and s["job"]["global_step"] > 20 else None)(get_json(url + "api/status")),
                        60, "every task to answer the attached dashboard")
        assert picture["job"]["name"] == "attached" and picture["job"]["mode"] == "async"
        assert [t["role"] for t in picture["tasks"]] == ["ps", "chief", "worker"]
        assert picture["job"]["target_step"] == 1200
        metrics = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
        assert re.search(r'tensorfleet_task_up\{[^}]*task="worker:1"[^}]*\} 1\.0', metrics), metrics
        stop.touch()
        code, output = job.wait()
        assert code == 0, output
        # The fleet is gone: the attached dashboard shows its tasks unreachable (or done), and keeps serving.
        poll(lambda: all(t["state"] in ("unreachable", "done") for t in get_json(url + "api/status")["tasks"]),
             30, "the dashboard to notice the fleet is gone")
        board.send_signal(signal.SIGTERM)
        assert board.wait(timeout=20) == 0
    finally:
        job.kill()
        if board is not None and board.poll() is None:
            board.kill()
            board.wait()


def test_a_dashboard_without_the_jobs_token_says_so_on_the_console_and_the_page(tmp_path):
    env = {**os.environ, auth.TOKEN_ENV: auth.new_token()}
    job = LauncherProcess(tmp_path / "logs", ["--ps", "1", "--workers", "1"], PACED,
                          ["--last_step", "100000", "--step_sleep_s", "0.01"], env=env)
    board = None
    try:
        addresses = started_addresses(job, 2)
        cluster = {"ps": [addresses["ps:0"]], "worker": [addresses["worker:0"]]}
        tokenless = {k: v for k, v in os.environ.items() if k not in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV)}
        board = subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", "dashboard", "--cluster",
                                  json.dumps(cluster)], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=tokenless)
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", board.stdout.readline()).group(1)
        picture = poll(lambda: (lambda s: s if {t["state"] for t in s["tasks"]} == {"refused"} else None)(
            get_json(url + "api/status")), 20, "both tasks to show refused")
        assert "TENSORFLEET_TOKEN" in picture["job"]["problem"], picture["job"]
        assert "ps:0, worker:0" in picture["job"]["problem"]
        said = board.stderr.readline()  # said once, on the console, as soon as the first poll was refused
        assert "refused its Status calls" in said and "TENSORFLEET_TOKEN" in said, said
        board.send_signal(signal.SIGTERM)
        assert board.wait(timeout=20) == 0
        assert "refused" not in board.stderr.read()  # once, not every poll
    finally:
        job.kill()
        if board is not None and board.poll() is None:
            board.kill()
            board.wait()


def test_an_attached_monitor_sees_a_fleet_started_by_hand_finish(tmp_path):
    """Tasks started by hand (no launcher, so no final status files): the end is seen all the same."""
    cluster = local_cluster(1, 2)
    env = {k: v for k, v in os.environ.items() if k not in (STATUS_DIR_ENV, auth.TOKEN_ENV)}
    monitor = FleetMonitor(cluster, job_name="by-hand").start()  # as `tensorfleet dashboard` does
    processes: dict[str, subprocess.Popen] = {}
    try:
        for task in fleet_tasks(cluster):
            with open(tmp_path / f"{task.job_name}-{task.index}.log", "w") as log:
                processes[task.short] = subprocess.Popen(
                    [sys.executable, str(PACED), "--last_step", "300", "--step_sleep_s", "0.01"], cwd=REPO,
                    env={**env, "TF_CONFIG": cluster.to_tf_config(TaskSpec(task.job_name, task.index))},
                    stdout=log, stderr=subprocess.STDOUT)
        picture = poll(lambda: (lambda s: s if s.job.state != "running" else None)(monitor.picture()),
                        90, "the attached monitor to see the job end", interval_s=0.1)
        assert picture.job.state == "succeeded", picture
        assert {t.name: t.state for t in picture.tasks} == dict.fromkeys(processes, "done")
        assert picture.job.global_step >= 300 and picture.job.eta_s is None
        points = len(picture.history)
        monitor.poll()  # a finished job gets no new chart points (and the monitor's thread stopped asking)
        assert len(monitor.picture().history) == points
        for name, process in processes.items():
            assert process.wait(timeout=30) == 0, (tmp_path / f"{name.replace(':', '-')}.log").read_text()
    finally:
        monitor.stop()
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()
