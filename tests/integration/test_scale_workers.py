"""Scaling a running asynchronous job: ``Launcher.scale_workers`` called from ``on_tick``, as the job service
calls it, with real processes on 127.0.0.1.

2 -> 3: the new worker joins mid-run and pushes; 3 -> 1: the two highest workers finish their step,
say Done and exit 0, and worker:0 trains on alone; 1 -> 2: worker:1 comes back as a new worker (the
ps does not count its earlier Done); the job ends with exit 0 and no process left.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import psutil
import pytest

from tensorfleet.backends.launcher import Launcher
from tensorfleet.backends.local import local_launcher
from tensorfleet.launch.config import JobConfig

pytestmark = pytest.mark.cluster
JOB = Path(__file__).resolve().parent / "scale_job.py"
DEADLINE_S = 100.0  # the whole job; it takes about 15 s on two cores


class Scaler:
    """The ``on_tick`` hook of the test, a small state machine over the monitor's picture."""

    def __init__(self, last_step_file: Path) -> None:
        self.last_step_file = last_step_file
        self.phase = "warming up"
        self.deadline = time.monotonic() + DEADLINE_S
        self.seen: dict[str, int] = {}

    def __call__(self, launcher: Launcher) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"the scaled job did not get past {self.phase!r} in {DEADLINE_S:g} s")
        picture = launcher.monitor.picture()
        step = picture.job.global_step
        steps = {task.name: task.step or 0 for task in picture.tasks}
        if self.phase == "warming up" and step >= 20:
            launcher.scale_workers(3)
            self.phase = "scaled up"
        elif self.phase == "scaled up" and steps.get("worker:2", 0) >= 5:
            self.seen["worker:2 steps"] = steps["worker:2"]  # it is in the picture, and it pushes
            launcher.scale_workers(1)
            self.phase = "scaling down"
        elif self.phase == "scaling down" and launcher.cluster.num_tasks("worker") == 1:
            self.seen["alone from"] = step  # the leavers are gone
            self.phase = "alone"
        elif self.phase == "alone" and step >= self.seen["alone from"] + 20:  # worker:0 trains on by itself
            launcher.scale_workers(2)  # worker:1 again: a new worker, on a new port
            self.phase = "scaled up again"
        elif self.phase == "scaled up again" and steps.get("worker:1", 0) >= 5:
            self.seen["ends at"] = step + 10
            self.last_step_file.write_text(str(step + 10))
            self.phase = "ending"


def test_an_async_job_scales_up_then_down_while_it_trains(tmp_path):
    logdir = tmp_path / "logs"
    config = JobConfig(script=str(JOB), args=["--last_step_file", str(tmp_path / "last_step")], ps=1, workers=2,
                       mode="async", max_restarts=1, logdir=str(logdir)).validate()
    scaler = Scaler(tmp_path / "last_step")
    out = io.StringIO()
    launcher = local_launcher(config, out=out, interactive=False, progress_every_s=1.0, on_tick=scaler)
    code = launcher.run()
    output = out.getvalue()
    assert code == 0, output
    assert scaler.phase == "ending" and scaler.seen["worker:2 steps"] >= 5

    events = [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"]) for e in events if e["event"] == "scaled"] == [(2, 3), (3, 1), (1, 2)]
    assert all(e["task"] is None for e in events if e["event"] == "scaled")
    of = lambda task, kind: [e for e in events if e["task"] == task and e["event"] == kind]  # noqa: E731
    assert len(of("worker:2", "started")) == 1 and of("worker:2", "running")
    for leaver in ("worker:2", "worker:1"):
        assert len(of(leaver, "leaving")) == 1, leaver
        leaving_at = of(leaver, "leaving")[0]["t"]
        exits = [e for e in of(leaver, "exited") if e["t"] >= leaving_at]
        assert [e["code"] for e in exits[:1]] == [0] and "restart" not in exits[0], events  # exit 0, not restarted
    assert not [e for e in events if e["event"] in ("failed", "stopped")], events
    # worker:1's second life: a new record (not restarted, not leaving), started on a new port.
    first, second = of("worker:1", "started")
    assert second["incarnation"] == 0 and second["pid"] != first["pid"]
    assert launcher.supervisor.by_name["worker:2"].state == "done" and launcher.supervisor.by_name["worker:2"].leaving
    for name in ("ps:0", "worker:0", "worker:1"):  # the ps exited by itself: every worker said Done
        record = launcher.supervisor.by_name[name]
        assert (record.state, record.exit_code, record.restarts, record.leaving) == ("done", 0, 0, False), name
    assert [t.short for t in launcher.tasks] == ["ps:0", "worker:0", "worker:1"]

    # worker:2 joined mid-run from the ps's current parameters, pushed, was asked to leave and said Done.
    log2 = (logdir / "worker-2.log").read_text()
    assert int(re.search(r"worker:2 starts at global step (\d+)", log2).group(1)) >= 20
    assert "asked to leave the job" in log2 and "worker:2 done at global step" in log2
    assert json.loads((logdir / "worker-2.status.json").read_text())["local_step"] >= 5
    # worker:0 and the new worker:1 trained on to the end.
    for log in ((logdir / "worker-0.log").read_text(), (logdir / "worker-1.log").read_text()):
        assert int(re.findall(r"worker:\d done at global step (\d+)", log)[-1]) >= scaler.seen["ends at"]

    # The ps learned each membership and counted the leavers' Done before forgetting them.
    ps_log = (logdir / "ps-0.log").read_text()
    order = [ps_log.index(text) for text in (
        "the job's workers are now 3 (were 2)", "/job:worker/task:2 said Done", "the job's workers are now 1 (were 3)",
        "the job's workers are now 2 (were 1)", "all 2 worker(s) done; exiting")]
    assert order == sorted(order), ps_log
    assert "/job:worker/task:1 said Done" in ps_log[:order[2]]
    last_two = re.findall(r"(/job:worker/task:\d) said Done \((\d) of 2\)", ps_log[order[3]:])
    assert sorted(last_two) == [("/job:worker/task:0", "1"), ("/job:worker/task:1", "2")] or \
        sorted(last_two) == [("/job:worker/task:0", "2"), ("/job:worker/task:1", "1")], ps_log

    pids = [e["pid"] for e in events if e["event"] == "started"]
    assert len(pids) == 5
    assert not [pid for pid in pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
