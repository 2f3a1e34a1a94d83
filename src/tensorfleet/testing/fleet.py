"""A fleet of real task processes that tests and benchmarks can kill and restart one by one.

ps tasks run ``python -m tensorfleet.ps``; workers run a given script with given
arguments; each task gets its TF_CONFIG and writes its output to its own log file
(``<job>:<index>.<incarnation>.log``).  The tasks run on 127.0.0.1, or each on a host
of its own in a ``tensorfleet.testing.network.Network`` (whose links the test can
slow down or cut).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.protocol.status import PsStatus
from tensorfleet.testing.network import Network
from tensorfleet.wire.rpc import Channel


class Fleet:
    """``num_ps`` ps + ``num_workers`` workers running ``script``; ``kill``/``start`` any task by name.

    With ``network``, each task runs on the host named after it (``"ps:0"``, ``"worker:1"``), and
    listens on ``TASK_PORT`` of that host's address.
    """

    TASK_PORT = 2222

    def __init__(self, logdir: Path, script: str | Path, script_args: Sequence[str] = (), *,
                 num_ps: int = 1, num_workers: int = 2, network: Network | None = None) -> None:
        self.network = network
        if network is None:
            self.cluster = local_cluster(num_ps, num_workers)
        else:
            self.cluster = ClusterSpec.from_dict({
                job: [f"{network.address(f'{job}:{i}')}:{self.TASK_PORT}" for i in range(count)]
                for job, count in (("ps", num_ps), ("worker", num_workers))})
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.script, self.script_args = str(script), list(script_args)
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        for task in [TaskSpec("ps", i) for i in range(num_ps)] + list(self.cluster.replicas):
            self.start(task.short)

    def start(self, name: str) -> None:
        job, index = name.split(":")
        env = {**os.environ, "TF_CONFIG": self.cluster.to_tf_config(TaskSpec(job, int(index)))}
        command = ([sys.executable, "-m", "tensorfleet.ps"] if job == "ps"
                   else [sys.executable, self.script, *self.script_args])
        if self.network is not None:
            command = self.network.command(name, command)
        self.starts[name] = self.starts.get(name, 0) + 1
        with open(self.logdir / f"{name}.{self.starts[name]}.log", "w") as log:
            self.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, name: str) -> None:
        """SIGKILL the task and reap it."""
        self.procs[name].kill()
        self.procs[name].wait()

    def log(self, name: str, incarnation: int | None = None) -> str:
        return (self.logdir / f"{name}.{incarnation or self.starts[name]}.log").read_text()

    def ps_status(self, index: int = 0, timeout_s: float = 30.0) -> PsStatus:
        """The Status of ps ``index``, waiting for it to listen (read strictly: a ps answering junk fails the test)."""
        channel = Channel(self.cluster.ps_addresses[index], task=f"/job:ps/task:{index}")
        try:
            return PsStatus.from_meta(channel.call("Status", timeout=timeout_s, wait_for_ready=True)[0])
        finally:
            channel.close()

    def wait_all(self, timeout_s: float = 150.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        for process in self.procs.values():
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        return {name: process.returncode for name, process in self.procs.items()}

    def stop(self) -> None:
        for process in self.procs.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def poll(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Return the first truthy value of ``condition()``; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
