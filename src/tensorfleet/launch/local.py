"""Start a whole cluster as local processes on 127.0.0.1, stream their output, tear it down.

Each task is ``python SCRIPT ARGS`` with its own ``TF_CONFIG``, in a process
group of its own (so a Ctrl-C reaches the launcher, which then stops every task
in order, rather than racing the tasks).  The job is over when every worker has
exited; the ps tasks then exit by themselves (each worker's Done tells them)
or are stopped after a grace period.  A ps that fails (non-zero exit) before
the workers finish ends the job: there is no restart yet, and the workers
could only wait for it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence, TextIO

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec

PS_EXIT_GRACE_S = 10.0
KILL_GRACE_S = 5.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_cluster(num_ps: int, num_workers: int, host: str = "127.0.0.1") -> ClusterSpec:
    """A cluster of ``num_ps`` ps and ``num_workers`` workers on free ports of ``host``."""
    ports = free_ports(num_ps + num_workers, host)
    return ClusterSpec.from_dict({"ps": [f"{host}:{p}" for p in ports[:num_ps]],
                                  "worker": [f"{host}:{p}" for p in ports[num_ps:]]})


@dataclass
class TaskProcess:
    task: TaskSpec
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    pump: threading.Thread | None = None


class LocalLauncher:
    """Runs one job: start every task, wait for the workers, stop the ps, report the exit code.

    Args:
        cluster: the tasks to start (every address must be on this machine).
        command: the program each task runs, e.g. ``[sys.executable, "examples/mnist_mlp.py", ...]``.
        out: where the prefixed output lines go.
        env: extra environment for every task.
    """

    def __init__(self, cluster: ClusterSpec, command: Sequence[str], *, out: TextIO = sys.stdout,
                 env: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        self.command = list(command)
        self.out = out
        self.env = dict(env or {})
        self.tasks: list[TaskProcess] = []
        self._out_lock = threading.Lock()
        self._stopping = threading.Event()

    def say(self, line: str) -> None:
        with self._out_lock:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def start(self) -> None:
        order = [TaskSpec("ps", i) for i in range(self.cluster.num_tasks("ps"))] + list(self.cluster.replicas)
        for task in order:
            env = {**os.environ, **self.env, "TF_CONFIG": self.cluster.to_tf_config(task), "PYTHONUNBUFFERED": "1"}
            process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
            tp = TaskProcess(task, process)
            tp.pump = threading.Thread(target=self._pump, args=(tp,), daemon=True, name=f"pump-{task.short}")
            tp.pump.start()
            self.tasks.append(tp)
            self.say(f"[launch] started {task.short} (pid {process.pid}) at "
                     f"{self.cluster.task_address(task.job_name, task.index)}")

    def _pump(self, tp: TaskProcess) -> None:
        assert tp.process.stdout is not None
        for raw in iter(tp.process.stdout.readline, b""):
            self.say(f"[{tp.task.short}] {raw.decode(errors='replace').rstrip()}")

    def wait(self, poll_s: float = 0.1) -> int:
        """Wait for the job to end; return 0 if every worker succeeded, else 1."""
        workers = [t for t in self.tasks if t.task.job_name != "ps"]
        ps_tasks = [t for t in self.tasks if t.task.job_name == "ps"]
        while not self._stopping.is_set() and any(t.process.poll() is None for t in workers):
            # A ps exits 0 once every worker said Done (workers may still be evaluating): that is normal.
            dead_ps = [t for t in ps_tasks if t.process.poll() not in (None, 0)]
            if dead_ps:
                self.say(f"[launch] {dead_ps[0].task.short} exited with code {dead_ps[0].process.returncode} "
                         "before the workers finished; stopping the job")
                self.stop()
                return 1
            time.sleep(poll_s)
        failed = [t for t in workers if t.process.returncode != 0]
        if not failed:  # every worker said Done, so the ps tasks are on their way out
            self._wait_for_exit(ps_tasks, PS_EXIT_GRACE_S)
        self.stop()
        for t in failed:
            self.say(f"[launch] {t.task.short} failed with exit code {t.process.returncode}")
        return 1 if failed or self._stopping.is_set() else 0

    def _wait_for_exit(self, tasks: list[TaskProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(t.process.poll() is None for t in tasks):
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every task still running: SIGTERM, then SIGKILL after a grace period."""
        alive = [t for t in self.tasks if t.process.poll() is None]
        for t in alive:
            _signal_group(t.process, signal.SIGTERM)
        self._wait_for_exit(alive, KILL_GRACE_S)
        for t in alive:
            if t.process.poll() is None:
                _signal_group(t.process, signal.SIGKILL)
                t.process.wait()
        for t in self.tasks:
            t.process.wait()
            if t.pump is not None:
                t.pump.join(timeout=2.0)

    def request_stop(self) -> None:
        """From a signal handler: make ``wait`` return and tear the job down."""
        self._stopping.set()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def launch(script: str, script_args: Sequence[str], *, num_ps: int, num_workers: int,
           out: TextIO = sys.stdout) -> int:
    """Run ``script`` as a local cluster of ``num_ps`` ps and ``num_workers`` workers; return the exit code."""
    cluster = local_cluster(num_ps, num_workers)
    launcher = LocalLauncher(cluster, [sys.executable, script, *script_args], out=out)

    def on_signal(signum: int, _frame: object) -> None:
        launcher.say(f"[launch] received {signal.Signals(signum).name}; stopping every task")
        launcher.request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        code = launcher.wait()
    finally:
        launcher.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    launcher.say(f"[launch] job {'succeeded' if code == 0 else 'FAILED'} (exit code {code})")
    return code
