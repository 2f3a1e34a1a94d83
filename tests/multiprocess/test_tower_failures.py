"""Failures among towers: spawned towers never outlive tower 0, a failed tower stops the others with its
name, and tower 0's error reaches every tower as the same class (so every tower recovers, or stops, alike)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.testing.local_cluster import REPO

pytestmark = pytest.mark.cluster
JOB = Path(__file__).parents[1] / "integration" / "towers_job.py"


@pytest.fixture(autouse=True)
def helpers_exit():
    """multiprocessing's resource tracker (started with the towers) exits a moment after its task: wait for it."""
    yield
    psutil.wait_procs(psutil.Process().children(recursive=True), timeout=10)


def test_towers_exit_when_tower_0_is_killed(tmp_path):
    # TMPDIR: a tower 0 killed by a signal cannot remove its rendezvous directory; keep it in tmp_path
    tower_0 = subprocess.Popen([sys.executable, str(JOB), "hang", "--towers", "3", "--tower_device", "cpu"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        lines = []
        for line in tower_0.stdout:  # every tower has joined the group (a barrier) once this line comes
            lines.append(line)
            if "towers up" in line:
                break
        assert "towers up" in "".join(lines), "".join(lines)
        started = psutil.Process(tower_0.pid).children(recursive=True)  # the towers and multiprocessing's helper
        assert len([p for p in started if "spawn_main" in " ".join(p.cmdline())]) == 2
        tower_0.send_signal(signal.SIGKILL)  # no cleanup code of tower 0 runs
        tower_0.wait(timeout=10)
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, f"outlived tower 0: {alive}"
    finally:
        if tower_0.poll() is None:
            tower_0.kill()
            tower_0.wait()


@pytest.mark.parametrize("how, expected", [
    (["--fail_tower", "1"], "tower-1 exited with code 1"),  # mid-training: tower 0 is in a collective
    ([], "towers could not start: tower-1 exited with code 3"),  # before the rendezvous
], ids=["while-training", "while-starting"])
def test_a_failed_tower_fails_the_task_at_once_naming_it(how, expected):
    env = {**os.environ, **({} if how else {"TOWERS_JOB_FAIL_ON_SPAWN": "1"})}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(JOB), "local", "--towers", "2", "--tower_device", "cpu",
                           "--steps", "5", "--out", os.devnull, *how], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert expected in done.stderr, done.stderr
    assert time.monotonic() - started < 60  # not the collective timeout (1800 s)


def test_tower_0s_error_reaches_every_tower_as_the_same_class():
    cluster = local_cluster(1, 1)  # nobody listens at the ps address: tower 0's Replica.start times out
    env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("worker", 0))}
    done = subprocess.run([sys.executable, str(JOB), "hybrid", "--towers", "2", "--tower_device", "cpu",
                           "--init_timeout_s", "2", "--out", os.devnull], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    # tower 1 raised the class tower 0 broadcast, naming it; tower 0 raised its own error, not a collective's
    assert "DeadlineExceededError: tower 0 of /job:worker/task:0 failed (DeadlineExceededError)" in done.stderr, \
        done.stderr
    last = done.stderr.rstrip().splitlines()[-1]  # torch prefixes rank 0's traceback with "[rank0]: "
    assert "tensorfleet.errors.DeadlineExceededError: waited 2 s for ps /job:ps/task:0" in last, done.stderr
