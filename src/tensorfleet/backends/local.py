"""The local engine (``--backend local``, the default): every task a process of this machine, on 127.0.0.1.

Each task's process is a child of the launcher's in a process group of its own (so a Ctrl-C reaches the
launcher, which then stops every task in order, rather than racing the tasks), and dies with the launcher: a
parent-death signal (Linux, see ``with_launcher_death``) ends it even if the launcher is SIGKILLed. Workers with
GPUs (``--gpus-per-worker``) get disjoint blocks of this machine's devices (``CUDA_VISIBLE_DEVICES``); a ps none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from tensorfleet.backends.api import Engine, TaskStarter
from tensorfleet.backends.launcher import Launcher
from tensorfleet.cluster import machine
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec

if TYPE_CHECKING:
    from tensorfleet.launch.config import JobConfig
    from tensorfleet.launch.supervisor import TaskRecord

_PR_SET_PDEATHSIG = 1


class LocalProcess:
    """A task's child process (``subprocess.Popen``), signalled by process group."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.stdout = popen.stdout

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int, group: bool = True) -> bool:
        """The group (the task's towers too: reached even once the task's own process exited, until the launcher
        lets go of it), else the process alone, while it runs (once reaped, its pid may be another process's)."""
        if not group and self.popen.poll() is not None:
            return False
        try:
            os.killpg(self.pid, sig) if group else os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


class LocalProcesses(TaskStarter):
    """Starts each task as a child process of this machine (see the module).

    Args:
        config: the job's settings (its GPUs per worker).
        gpus_available: this machine's GPUs as counted (None: ask CUDA, when GPUs are asked for).
    """

    def __init__(self, config: "JobConfig", *, gpus_available: int | None = None) -> None:
        self.config = config
        self._gpus_available = gpus_available
        self._gpus = self._assign(config.workers)  # each worker's CUDA_VISIBLE_DEVICES (None: no GPUs asked for)

    def _assign(self, workers: int) -> list[str] | None:
        if not self.config.gpus_per_worker:
            return None
        available = machine.visible_gpus() if self._gpus_available is None else self._gpus_available
        return machine.gpu_assignment(self.config.gpus_per_worker, workers, available)

    def place(self, num_ps: int, num_workers: int, first_port: int | None) -> ClusterSpec:
        return local_cluster(num_ps, num_workers, first_port=first_port)

    def task_env(self, task: TaskSpec, replica: int | None) -> dict[str, str]:
        if self._gpus is None:
            return {}
        if replica is None:
            return {"CUDA_VISIBLE_DEVICES": ""}  # a ps holds variables on the CPU
        return {"CUDA_VISIBLE_DEVICES": self._gpus[replica],
                "TENSORFLEET_GPUS_PER_WORKER": str(self.config.gpus_per_worker)}

    def start(self, record: "TaskRecord", command: list[str]) -> LocalProcess:
        """A child of the launcher's in a session of its own; its output on ``stdout``."""
        env = {**os.environ, **self.host.task_env(record.task)}
        return LocalProcess(subprocess.Popen(with_launcher_death(command), env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True))

    def reserve_for_workers(self, workers: int, current: int) -> None:
        """Each worker's GPUs of this machine, or ConfigError."""
        if self.config.gpus_per_worker:
            self._gpus = self._assign(max(workers, current))


def local_launcher(config: "JobConfig", *, gpus_available: int | None = None, **kwargs: Any) -> Launcher:
    """The launcher of a local job (``kwargs``: ``Launcher``'s)."""
    return Launcher(config, LocalProcesses(config, gpus_available=gpus_available), **kwargs)


class LocalEngine(Engine):
    name = "local"
    title = "local"

    def runs_on_this_machine(self, config: "JobConfig") -> bool:
        return True

    def dry_run_text(self, config: "JobConfig") -> str:
        return local_launcher(config).dry_run_text()

    def starter(self, config: "JobConfig") -> LocalProcesses:
        return LocalProcesses(config)


ENGINE = LocalEngine()


def with_launcher_death(command: list[str]) -> list[str]:
    """``command``, run so that it dies with this launcher however the launcher dies, SIGKILL included.

    On Linux a tiny interpreter arms a parent-death signal (SIGTERM), checks the launcher is
    still there, and execs the command in its own place (same pid).  Not a ``preexec_fn``:
    that would run gRPC's fork handlers in the child of a launcher whose monitor uses gRPC,
    which aborts it.  Elsewhere the command is returned as it is.
    """
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _ARM_PARENT_DEATH_SIGNAL, str(os.getpid()), *command]


_ARM_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")
