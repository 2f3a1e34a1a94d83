"""``tensorfleet launch`` as a supervisor, with real processes: restarts, giving up, logs, progress, summary."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import REPO, LauncherProcess

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"


@pytest.fixture
def launches(tmp_path):
    started: list[LauncherProcess] = []

    def start(flags, script_args, name="job"):
        run = LauncherProcess(tmp_path / name, ["--progress-every", "1", *flags], PACED, script_args)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


def summary_rows(output: str) -> dict[str, list[str]]:
    """The summary table's rows by task: role, state, exit, restarts, wall time."""
    rows = {}
    for line in output.splitlines():
        match = re.match(r"\[launch\] ((?:ps|worker):\d+)\s+(\w+)\s+(\w+)\s+(\S+)\s+(\d+)\s+([\d.]+ s)$", line)
        if match:
            rows[match.group(1)] = list(match.groups()[1:])
    return rows


def test_a_killed_worker_is_restarted_rejoins_and_the_job_succeeds(launches):
    run = launches(["--ps", "1", "--workers", "2"], ["--last_step", "700", "--step_sleep_s", "0.01"])
    first = poll(lambda: run.events_of("worker:1", "running"), 60, "worker:1 to answer its Status RPC")
    pid = run.events_of("worker:1", "started")[0]["pid"]
    assert first and psutil.pid_exists(pid)
    # Every task has the job's token in its environment, never on its command line.
    token = psutil.Process(pid).environ()["TENSORFLEET_TOKEN"]
    assert len(token) == 64 and token not in " ".join(psutil.Process(pid).cmdline())
    os.kill(pid, signal.SIGKILL)
    poll(lambda: run.events_of("worker:1", "exited"), 30, "the launcher to see worker:1 die")
    poll(lambda: len(run.events_of("worker:1", "running")) == 2, 60, "worker:1 to run again")
    code, output = run.wait()
    assert code == 0, output

    exited = run.events_of("worker:1", "exited")[0]
    assert exited["how"] == "killed by SIGKILL" and exited["restart"] == 1 and exited["delay_s"] == 1.0
    restarted = run.events_of("worker:1", "started")
    assert len(restarted) == 2 and restarted[1]["incarnation"] == 1 and restarted[1]["pid"] != pid
    assert "[launch] worker:1 killed by SIGKILL; restarting in" in output
    assert "started worker:1 (restart 1)" in output
    assert "worker:1 starts at global step" in output  # the new incarnation rejoined mid-run
    rows = summary_rows(output)
    assert rows["worker:1"][:4] == ["worker", "done", "0", "1"], output
    assert rows["worker:0"][:4] == ["chief", "done", "0", "0"] and rows["ps:0"][:4] == ["ps", "done", "0", "0"]
    assert re.search(r"job paced-job succeeded after [\d.]+ s \(exit code 0\), 1 restart, global step 70\d", output)
    # Progress lines for the whole job, not per step: global step / target, rates, ETA.
    progress = [line for line in output.splitlines() if re.match(r"\[launch\] step [\d,]+/700 ", line)]
    assert progress and len(progress) < 60, output
    assert any("ex/s" in line and "steps/s" in line and "ETA" in line for line in progress), progress
    # Per-task logs: both incarnations of worker:1 in one file.
    log = (run.logdir / "worker-1.log").read_text()
    first, second = log.split("=== worker:1 incarnation 1,")
    assert "=== worker:1 incarnation 0," in first and "done at global step" not in first
    assert re.search(r"starts at global step [1-9]\d*", second) and "done at global step 70" in second


def test_restart_never_fails_the_job_with_a_summary(launches):
    run = launches(["--restart", "never"], ["--last_step", "100000", "--step_sleep_s", "0.01"])
    poll(lambda: run.events_of("worker:1", "running"), 60, "worker:1 to run")
    os.kill(run.events_of("worker:1", "started")[0]["pid"], signal.SIGKILL)
    code, output = run.wait()
    assert code == 1, output
    assert "worker:1 failed: killed by SIGKILL; not restarted because the restart policy is 'never'" in output
    assert "job paced-job FAILED" in output
    rows = summary_rows(output)
    assert rows["worker:1"][1:4] == ["failed", "SIGKILL", "0"], output
    assert rows["worker:0"][1] == "stopped" and rows["ps:0"][1] == "stopped"


def test_a_task_that_keeps_crashing_is_given_up_after_max_restarts(launches):
    run = launches(["--max-restarts", "2"], ["--fail", "worker:1", "--fail_after_s", "3", "--last_step", "100000"])
    code, output = run.wait()
    assert code == 1, output
    exits = run.events_of("worker:1", "exited")
    assert [e["restart"] for e in exits] == [1, 2] and [e["delay_s"] for e in exits] == [1.0, 2.0]
    failed = run.events_of("worker:1", "failed")
    assert len(failed) == 1 and "already restarted 2 time(s)" in failed[0]["reason"]
    assert "worker:1: failing on purpose" in output  # the tail of its log is in the summary
    assert summary_rows(output)["worker:1"][1:4] == ["failed", "1", "2"], output


def test_a_crash_at_start_up_is_retried_once_and_its_traceback_shown_once(launches):
    run = launches(["--max-restarts", "3"], ["--fail", "worker:1", "--last_step", "100000"])
    code, output = run.wait()
    assert code == 1, output
    assert [e["restart"] for e in run.events_of("worker:1", "exited")] == [1]
    failed = run.events_of("worker:1", "failed")
    assert len(failed) == 1 and "at start-up twice in a row" in failed[0]["reason"], failed
    shown = [line for line in output.splitlines() if "failing on purpose" in line]
    assert shown == ["[worker:1] worker:1: failing on purpose"], output  # once, though it ran twice
    assert "1 line(s) of its output repeat a crash shown above" in output
    log = (run.logdir / "worker-1.log").read_text()
    assert log.count("failing on purpose") == 2  # the log keeps every incarnation


def test_sync_flag_reaches_every_task_through_the_environment(launches):
    run = launches(["--sync", "--workers", "2"], ["--last_step", "30", "--step_sleep_s", "0"])
    code, output = run.wait()
    assert code == 0, output
    assert "initialized 2 variable(s), optimizer sgd" in output and ", sync" in output


def test_dry_run_prints_tasks_ports_and_environment_and_starts_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--dry-run", "--ps", "2",
                           "--workers", "3", "--sync", "--port", "23000", "--logdir", str(tmp_path / "logs"),
                           str(PACED), "--", "--last_step", "5"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "job paced-job: 2 ps + 3 worker(s), mode sync, restart on-failure (up to 3 times per task)" in out
    for name, port in [("ps:0", 23000), ("ps:1", 23001), ("worker:0", 23002), ("worker:2", 23004)]:
        assert f"{name} (" in out and f"127.0.0.1:{port}" in out
    assert "worker:0 (chief)" in out and "TENSORFLEET_MODE=sync" in out
    assert out.count("TENSORFLEET_TOKEN=<the job's secret token>") == 5  # never printed
    tf_configs = re.findall(r"TF_CONFIG='(.*)'", out)
    assert len(tf_configs) == 5
    assert json.loads(tf_configs[4])["task"] == {"type": "worker", "index": 2}
    assert "--last_step 5" in out
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written


def test_a_dashboard_port_in_use_is_one_line_exit_2_and_nothing_starts(tmp_path):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--dashboard", str(port),
                               "--logdir", str(tmp_path / "logs"), str(PACED)], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot serve the dashboard on 127.0.0.1:{port}" in done.stderr
    assert "started" not in done.stdout


def test_a_task_port_in_use_is_refused_before_anything_starts(tmp_path):
    """Issue 44: with --port P and P+1 taken, the task on it crashed twice with a traceback; now one line, exit 2."""
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--port", str(port - 1), "--ps", "1",
                   "--workers", "2", "--logdir", str(tmp_path / "logs"), str(PACED)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        dry = subprocess.run(command[:4] + ["--dry-run"] + command[4:], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1, line
    held = re.fullmatch(r"tensorfleet launch: error: ports? ([\d, ]+) of 127\.0\.0\.1 (?:is|are) taken, and the "
                        rf"job's 3 tasks listen on {port - 1}\.\.{port + 1} \(--port {port - 1}\): stop what holds "
                        r"(?:it|them), give another --port, or leave --port out for free ports", line)
    assert held is not None and str(port) in held[1].split(", "), line
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written
    assert dry.returncode == 0 and f"ports from {port - 1} (" in dry.stdout, dry.stdout + dry.stderr
    assert "taken now: a run would refuse to start)" in dry.stdout


def test_the_dashboard_on_a_task_port_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--port", "23100", "--dashboard",
                           "23101", "--logdir", str(tmp_path / "logs"), str(PACED)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("tensorfleet launch: error: the dashboard's port 23101 is one of the tasks' ports "
                                   "23100..23102 (--port 23100): give the dashboard another port")
    assert not (tmp_path / "logs").exists()


def test_a_between_graph_script_under_coordinator_ends_at_once_saying_what_to_do(tmp_path):
    """Issue 44: examples/mnist_mlp.py (run_task) under --coordinator trained on every worker by itself."""
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator", "--ps", "1",
                           "--workers", "1", "--logdir", str(tmp_path / "logs"), "examples/mnist_mlp.py", "--",
                           "--train_steps", "50"], cwd=REPO, capture_output=True, text=True, timeout=90)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert ("mnist_mlp.py: error: this script is between-graph (it calls tfl.run_task: each worker trains by "
            "itself), but 'tensorfleet launch --coordinator' started it for in-graph replication") in output
    assert "launch it without --coordinator, or write it with tfl.run_coordinated" in output
    assert "Traceback" not in output and "training begins" not in output, output
    assert "restart 1" not in output  # exit 2: never retried


def _gone(pid: int) -> bool:
    """Dead, or a zombie (this test process is a subreaper: orphans come back to it to be reaped)."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return False
        os.waitpid(pid, os.WNOHANG)
    except (psutil.NoSuchProcess, ChildProcessError):
        pass
    return True


@pytest.mark.parametrize("when", ["starting", "running"])
def test_tasks_die_with_a_sigkilled_launcher(launches, when):
    run = launches([], ["--last_step", "100000", "--step_sleep_s", "0.01"], name=when)
    poll(lambda: len(run.events_of("worker:1", "started" if when == "starting" else "running")), 60,
         f"worker:1 {when}")
    pids = [e["pid"] for e in run.events() if e["event"] == "started"]
    assert len(pids) == 3
    run.process.kill()  # no SIGTERM handler, no cleanup: the launcher is simply gone
    run.process.wait()
    poll(lambda: all(_gone(pid) for pid in pids), 10, "every task to die with the launcher")
