"""Documented jobs run to their end as a user types them: the click-through example under the launcher (its
chief's final printout once crashed on a typed Status), and the coordinator page's notebook block against a fleet started
with ``--coordinator-outside`` (it once failed on a missing ``ARGS`` and never ended its job). Each ends with
the final metric its script reported in the launcher's summary."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorfleet.testing.local_cluster import REPO, LauncherProcess, run_launcher

pytestmark = pytest.mark.cluster
COORDINATOR_PAGE = (REPO / "docs" / "coordinator.md").read_text(encoding="utf-8")  # what the README links to


def test_the_click_through_example_runs_to_its_end_and_reports_its_auc():
    job = run_launcher(REPO / "examples" / "click_through.py",
                       ["--train_steps", "60", "--batch_size", "256", "--table_size", "100000", "--eval_batches", "2",
                        "--log_every", "20"], num_ps=2, num_workers=2, timeout_s=240)
    assert job.returncode == 0, job.output
    assert re.search(r"\[worker:0\] held-out AUC: 0\.\d{4}", job.output), job.output
    shards = re.findall(r"\[worker:0\] /job:ps/task:(\d): rows user [\d,]+, item [\d,]+", job.output)
    assert sorted(shards) == ["0", "1"], job.output  # the per-shard rows, read from the typed Status
    assert re.search(r"succeeded after .*, 0 restarts, global step \d+", job.output), job.output
    assert re.search(r"\[launch\] metrics: auc 0\.\d{4}", job.output), job.output


def _notebook_block() -> tuple[str, str]:
    """The coordinator page's "From a notebook" launch command and the Python block after it."""
    part = COORDINATOR_PAGE[COORDINATOR_PAGE.index("**From a notebook.**"):]
    command = re.search(r"```\n(tensorfleet launch [^\n]*)\n```", part).group(1)
    code = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    return command, code


def test_the_readmes_notebook_block_trains_and_ends_the_job(tmp_path: Path):
    """The two blocks as a reader runs them from a checkout: the launch command in a terminal, the Python block in
    a session; the session's last line ends the job, and the launcher's summary says so."""
    command, code = _notebook_block()
    (tmp_path / "examples").symlink_to(REPO / "examples")
    words = command.split()
    assert words[0] == "tensorfleet"
    launcher = subprocess.Popen([sys.executable, "-m", "tensorfleet.cli", *words[1:]], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        session = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=240)
        assert session.returncode == 0, session.stdout + session.stderr
        output = launcher.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, output
    assert re.search(r"\[launch\] job \S+ succeeded after .*, global step (\d+)", output), output
    step = int(re.search(r"global step (\d+)", output.split("[launch] job ")[-1]).group(1))
    assert step >= 2000, output  # 40 closures of 50 steps
    assert not (tmp_path / "runs" / "nb" / "coordinator.json").exists()  # a finished job leaves none to join


def test_joining_the_logdir_of_a_finished_job_is_refused_at_once(tmp_path: Path):
    """A coordinator.json whose launcher has ended names a fleet that is gone: refused with what to do, at once."""
    from tensorfleet.coordinator.outside import join_fleet
    from tensorfleet.errors import ConfigError

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    token = tmp_path / "coordinator.token"
    token.write_text("secret")
    token.chmod(0o600)
    tf_config = {"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]},
                 "task": {"type": "chief", "index": 0}}
    (tmp_path / "coordinator.json").write_text(json.dumps(
        {"tf_config": json.dumps(tf_config), "token_file": str(token), "launcher_pid": ended.pid}))
    with pytest.raises(ConfigError, match="left by a launcher that has ended .* start the fleet with"):
        join_fleet(tmp_path, timeout_s=5)


def test_joining_a_logdir_that_does_not_exist_says_what_it_waits_for_at_once(tmp_path: Path, caplog):
    from tensorfleet.coordinator.outside import join_fleet
    from tensorfleet.errors import DeadlineExceededError

    with caplog.at_level("WARNING"), pytest.raises(DeadlineExceededError):
        join_fleet(tmp_path / "missing", timeout_s=0.3)
    said = [r.getMessage() for r in caplog.records]
    assert any("waiting up to 0.3 s" in m and "--coordinator-outside" in m and "does not exist yet" in m
               for m in said), said


def test_the_coordinator_is_followed_as_a_chief_is_under_launch_coordinator(tmp_path: Path):
    """``tensorfleet launch --coordinator``: the coordinator answers its Status, so it is running (not "starting")
    in the progress line, which knows the target step; the summary has its accuracy."""
    launcher = LauncherProcess(tmp_path / "logs", ["--coordinator", "--ps", "1", "--workers", "2"],
                               REPO / "examples" / "mnist_coordinator.py", ["--train_steps", "2000"])
    try:
        code, output = launcher.wait(timeout_s=240)
    finally:
        launcher.kill()
    assert code == 0, output
    assert launcher.events_of("chief:0", "running"), output  # it answered its Status
    assert re.search(r"\[launch\] step [\d,]+/2,000 \(\d+%\) .*4/4 tasks running", output), output
    assert re.search(r"\[launch\] metrics: accuracy 0\.9\d{3}", output), output


def test_a_notebook_session_that_died_is_said_and_shown_unreachable(tmp_path: Path):
    """``--coordinator-outside``: a session that joined and then died is said on the launcher's console (with how to
    join again), not shown running forever."""
    logdir = tmp_path / "logs"
    launcher = LauncherProcess(logdir, ["--coordinator-outside", "--ps", "1", "--workers", "1"],
                               REPO / "examples" / "mnist_coordinator.py")
    try:
        joined = subprocess.Popen([sys.executable, "-c", "import sys, tensorfleet as tfl; tfl.join_fleet(sys.argv[1]); "
                                   "print('joined', flush=True); sys.stdin.read()", str(logdir)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert joined.stdout.readline().strip() == "joined"
        deadline = time.monotonic() + 60
        while not launcher.events_of("chief:0", "running") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.events_of("chief:0", "running"), launcher.output
        joined.kill()  # the notebook's kernel dies
        joined.wait()
        while "chief:0, the coordinator, stopped answering" not in launcher.output and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"join again with tfl.join_fleet({str(logdir.resolve())!r})" in launcher.output, launcher.output
        launcher.process.send_signal(signal.SIGINT)  # Ctrl-C: the user gives up on the job
        code, output = launcher.wait(timeout_s=60)
        assert code == 130, output
    finally:
        launcher.kill()
