"""Issue 29: every ``tensorfleet`` command ends quietly when its reader goes away (``... | head -1``) or the user
presses Ctrl-C: no traceback, at most one short line, the exit codes a shell expects (141, 130).

The commands run as real processes. A pipe whose reading end is closed before the command starts stands for
``| head -1``: head exits after its line whenever it likes, so a real pipeline would only sometimes catch a
write after it; here every write fails, every time.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import running_service

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
PACED = Path(__file__).resolve().parent / "paced_job.py"
TENSORFLEET = [sys.executable, "-m", "tensorfleet.cli"]  # the `tensorfleet` entry point


def into_a_closed_pipe(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``tensorfleet ARGV`` with its stdout a pipe nobody reads any more."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*TENSORFLEET, *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=cwd)
    finally:
        os.close(write)


def assert_quiet_broken_pipe(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)


@pytest.mark.parametrize("argv", [
    ["launch", "--dry-run", "--workers", "1", "examples/hello_cluster.py"],
    ["k8s", "render", "--ps", "2", "--workers", "8", "--image", "repo/t:1", "--token-secret", "s", "train.py"],
    ["ckpt", "ls", "."],
], ids=["launch-dry-run", "k8s-render", "ckpt-ls"])
def test_a_command_whose_reader_is_gone_ends_quietly(argv):
    assert_quiet_broken_pipe(into_a_closed_pipe(argv))


def test_jobs_ls_into_head_ends_quietly(tmp_path):
    """``tensorfleet jobs ls | head -1`` against a real job service."""
    with running_service(tmp_path / "home", tmp_path) as service:
        done = into_a_closed_pipe(["jobs", "ls", "--url", service.url, "--token", service.token])
    assert_quiet_broken_pipe(done)


def read_until(process: subprocess.Popen, text: str, timeout_s: float) -> str:
    """What ``process`` printed on stdout up to and including ``text``; fails after ``timeout_s``."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and process.poll() is None, f"no {text!r} within {timeout_s} s: {seen!r}"
        if select.select([process.stdout], [], [], left)[0]:
            seen += os.read(process.stdout.fileno(), 65536)
    return seen.decode()


def test_ctrl_c_on_jobs_logs_follow_ends_quietly_with_130(tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    shutil.copy(PACED, workspace / "paced_job.py")
    with running_service(tmp_path / "home", workspace) as service:
        job = service.client().call("POST", "/api/jobs", {
            "script": "paced_job.py", "args": ["--last_step", "100000", "--step_sleep_s", "0.2"], "ps": 1,
            "workers": 1, "mode": "async"})
        follow = subprocess.Popen([*TENSORFLEET, "jobs", "logs", str(job["id"]), "worker:0", "--follow", "--url",
                                   service.url, "--token", service.token], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        try:
            read_until(follow, "worker:0 starts at global step", timeout_s=120)  # it follows the live log now
            follow.send_signal(signal.SIGINT)
            _, err = follow.communicate(timeout=30)
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait(10)
        service.client().call("POST", f"/api/jobs/{job['id']}/stop", {})
        poll(lambda: service.job(job["id"])["finished_at"] is not None, 60, "the job to stop")
    text = err.decode()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert len(text.strip().splitlines()) <= 1, text
    assert follow.returncode == 130, (follow.returncode, text)
