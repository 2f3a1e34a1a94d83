"""The task starter's contract (``backends/api.py``), run for real on any starter: what every engine's starter is
held to (``tests/unit/test_backends.py`` runs it on the local one, ``tests/integration/test_ray_backend.py`` on
Ray's, against its cluster).

It places a job of 1 ps + 1 worker, starts a task that prints its task and a digest of the job token and exits
with a code of its own, starts one that waits and signals it, and lets go (twice: the second does nothing).
"""

from __future__ import annotations

import hashlib
import signal
import sys
import time
from pathlib import Path

from tensorfleet.backends.api import TaskProcess, TaskStarter
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.launch.monitor import fleet_tasks, task_role
from tensorfleet.launch.supervisor import TaskRecord
from tensorfleet.wire.auth import TOKEN_ENV

TOKEN = "c0ffee" * 8
TASK_SCRIPT = """\
import hashlib, json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("task", task["type"], task["index"], hashlib.sha256(os.environ["TENSORFLEET_TOKEN"].encode()).hexdigest())
if sys.argv[1] == "wait":
    print("waiting", flush=True)
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


class ContractHost:
    """The launcher as a starter sees it (``FleetHost``): the cluster, each task's environment, what it says."""

    def __init__(self) -> None:
        self.cluster: ClusterSpec | None = None
        self.lines: list[str] = []
        self.lost: dict[str, str] = {}

    def task_env(self, task: TaskSpec) -> dict[str, str]:
        assert self.cluster is not None
        return {"TF_CONFIG": self.cluster.to_tf_config(task), TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1"}

    def say(self, line: str) -> None:
        self.lines.append(line)

    def task_lost(self, name: str, how: str) -> None:
        self.lost[name] = how

    def task_moved(self, name: str, address: str) -> None:
        raise AssertionError(f"{name} moved to {address}: nothing died here")


def read_all(process: TaskProcess, deadline_s: float = 60.0) -> list[str]:
    """Every line of a task's output until it ends."""
    lines, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        raw = process.stdout.readline()
        if raw == b"":
            return lines
        lines.append(raw.decode().rstrip("\n"))
    raise AssertionError(f"the task's output did not end within {deadline_s} s: {lines}")


def check_task_starter(starter: TaskStarter, script: Path, logdir: Path) -> None:
    """Hold ``starter`` (made for a job of 1 ps + 1 worker whose script is ``script``, holding ``TASK_SCRIPT``)
    to the contract; AssertionError says what it broke."""
    host = ContractHost()
    starter.attach(host)
    host.cluster = starter.place(1, 1, None)
    assert host.cluster.num_tasks("ps") == 1 and host.cluster.num_tasks("worker") == 1
    addresses = [host.cluster.task_address("ps", 0), host.cluster.task_address("worker", 0)]
    assert len(set(addresses)) == 2 and all(a.rpartition(":")[2].isdigit() for a in addresses), addresses
    starter.open(logdir)
    records = {t.short: TaskRecord(t, host.cluster.task_address(t.job_name, t.index), task_role(host.cluster, t))
               for t in fleet_tasks(host.cluster)}
    for task, replica in ((records["ps:0"].task, None), (records["worker:0"].task, 0)):
        for key in starter.task_env(task, replica):
            assert key not in (TOKEN_ENV, "TF_CONFIG"), "a starter adds variables of its own only"

    # A task runs with its TF_CONFIG and the job token, prints, and exits with its own code.
    process = starter.start(records["worker:0"], [sys.executable, str(script), "3"])
    assert isinstance(process.pid, int)
    assert read_all(process) == [f"task worker 0 {hashlib.sha256(TOKEN.encode()).hexdigest()}"]
    assert process.wait(30) == 3 and process.poll() == 3
    assert not process.signal(signal.SIGTERM), "an exited task cannot be signalled"
    assert isinstance(starter.placement("worker:0", records["worker:0"].address), dict)

    # A task that waits is signalled, and its exit says so.
    process = starter.start(records["ps:0"], [sys.executable, str(script), "wait"])
    assert process.stdout.readline().decode().startswith("task ps 0 ")
    assert process.stdout.readline() == b"waiting\n"
    assert process.signal(signal.SIGTERM, group=True)
    read_all(process)
    assert process.wait(30) == -signal.SIGTERM and process.poll() == -signal.SIGTERM
    assert host.lost == {}

    starter.release()
    starter.release()  # the launcher's stop and its error paths may both let go: the second does nothing
