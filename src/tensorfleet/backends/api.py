"""What an engine is to the rest of tensorfleet: two small interfaces, and the engine that offers one of them.

* ``TaskStarter``: starts one task's process somewhere (a child process here, a Ray actor's on a node) and
  signals it. The one launcher loop (``backends/launcher.py``: supervision, restarts, logs, events, progress,
  the dashboard, scaling) drives it; the starter knows nothing of restarts or the job's end.
* ``JobSubmitter``: hands a whole job to a scheduler that runs every task itself (Slurm), follows it until it
  ends, and cancels it when asked.

An ``Engine`` (one per module of ``backends/``, named in the registry, ``backends/__init__.py``) checks a job's
settings for itself and gives one or the other for a job.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Protocol

from tensorfleet.cluster.ports import free_ports
from tensorfleet.dashboard.picture import FleetPicture

if TYPE_CHECKING:
    from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
    from tensorfleet.launch.config import JobConfig
    from tensorfleet.launch.supervisor import TaskRecord


class StillPlacing(Exception):
    """``TaskStarter.start`` of a restart: the task cannot start yet (its new place is being found); ask again in
    ``retry_in_s`` seconds, the loop goes on meanwhile. (A job's first starts are placed by ``place``: a task that
    has no place then is a ConfigError, before anything runs.)"""

    def __init__(self, retry_in_s: float) -> None:
        super().__init__(f"still being placed; again in {retry_in_s:g} s")
        self.retry_in_s = retry_in_s


class Unplaced(Exception):
    """``TaskStarter.start``: the task has no place to run any more (no node took it in time); it fails for good,
    and the message says why."""


class TaskProcess(Protocol):
    """A task's running process as the loop sees it, wherever it runs (``subprocess.Popen``'s shape)."""

    pid: int
    stdout: Any  # .readline() -> bytes: the next line of its output, b"" once it exited and all was read

    def poll(self) -> int | None:
        """Its exit code once it exited and its last line was read; None while it runs."""

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for its exit (at most ``timeout`` seconds); its code, or None."""

    def signal(self, sig: int, group: bool = True) -> bool:
        """Send ``sig`` to its process group (``group``: the task's towers too), else to the process alone;
        False if it is not running."""


class FleetHost(Protocol):
    """What a starter may tell the launcher of its tasks (the launcher is the one host): ``task_lost`` from any
    thread (an output pump's), the others from the supervising thread (within ``start``, ``prepare_worker``)."""

    @property
    def cluster(self) -> "ClusterSpec":
        """The job's cluster now."""

    def say(self, line: str) -> None:
        """A line for the console."""

    def task_env(self, task: "TaskSpec") -> dict[str, str]:
        """The variables the task starts with now (its TF_CONFIG, the job token, ...), on top of its node's."""

    def task_lost(self, name: str, how: str) -> None:
        """Task ``name``'s process is gone with its place (a node that died): its exit is told as ``how``."""

    def task_moved(self, name: str, address: str) -> None:
        """Task ``name`` listens at ``address`` from its next start: the cluster follows it."""


class TaskStarter(ABC):
    """Starts, places and signals the processes of a job's tasks for the launcher loop (one per job)."""

    def attach(self, host: FleetHost) -> None:
        """The launcher this starter serves (called once, before ``place``)."""
        self.host = host

    @abstractmethod
    def place(self, num_ps: int, num_workers: int, first_port: int | None) -> "ClusterSpec":
        """Where the job's ``num_ps`` ps and ``num_workers`` workers will listen (jobs "ps" and "worker")."""

    def placeholder_ports(self, count: int, host: str) -> list[int]:
        """Ports for workers a scale-up adds, until ``prepare_worker`` says where they really are."""
        return free_ports(count, host)

    def task_env(self, task: "TaskSpec", replica: int | None) -> dict[str, str]:
        """What this engine adds to a task's environment (its GPUs); ``replica``: a worker's index."""
        return {}

    def open(self, logdir: Path) -> None:
        """The job starts, with its logs in ``logdir``."""

    @abstractmethod
    def start(self, record: "TaskRecord", command: list[str]) -> TaskProcess:
        """Start the task's process, ``command`` with ``host.task_env(record.task)`` on top of its node's
        environment, asked for once the task's place is known (it may have moved). The job token is in it: a
        starter whose calls cross a network seals it. Raises StillPlacing or Unplaced."""

    def placement(self, name: str, address: str) -> dict[str, str]:
        """Where task ``name`` runs, for its "started" event and the console ({"node": ...}; {} for here)."""
        return {}

    def reserve_for_workers(self, workers: int, current: int) -> None:
        """Room for ``workers`` workers (``current`` now), or ConfigError saying what is missing."""

    def prepare_worker(self, record: "TaskRecord") -> None:
        """A worker a scale-up added is about to start: find it a place (it may move: ``FleetHost.task_moved``)."""

    def fleet_changed(self, names: set[str]) -> None:
        """The job's tasks are ``names`` now (a scale-down removed some): let go of the others' places."""

    def release(self) -> None:
        """The job is over: every process is gone; let go of what the starter holds."""


class JobSubmitter(ABC):
    """A whole job run by a scheduler: submitted once, followed until it ends (``run``)."""

    job_id: str | None = None  # the scheduler's id, once submitted

    @abstractmethod
    def run(self) -> int:
        """Submit the job and follow it to its end; 0 succeeded, 130 cancelled (Ctrl-C, SIGTERM), 1 failed."""

    @abstractmethod
    def picture(self) -> FleetPicture:
        """The job as the scheduler and the tasks' output tell it."""


@dataclass(frozen=True)
class PlannedTask:
    """A task as its engine will start it (for the job service's page before the task runs)."""

    name: str
    role: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Engine(ABC):
    """One engine of the registry: checks a job for itself, and gives a ``TaskStarter`` (the launcher loop runs
    the tasks) or a ``JobSubmitter`` (a scheduler does)."""

    name: str = ""  # its registry name, the value of a job's ``backend``
    title: str = ""  # its name in a sentence ("Slurm")
    submits: bool = False  # a scheduler runs the job's tasks (``submitter``); else the launcher loop (``starter``)

    def check(self, config: "JobConfig") -> None:
        """Refuse, with ConfigError, what this engine cannot run (checked before anything starts)."""

    def runs_on_this_machine(self, config: "JobConfig") -> bool:
        """Whether the job's tasks share this machine's cores."""
        return False

    def for_service(self, config: "JobConfig", environ: dict[str, str]) -> None:
        """Make ``config`` the job-service runner's (its environment ``environ`` says where the service's cluster
        is); ConfigError where the runner cannot run it."""

    @abstractmethod
    def dry_run_text(self, config: "JobConfig") -> str:
        """What a run would start, starting nothing."""

    def starter(self, config: "JobConfig") -> TaskStarter | None:
        """The starter of the job's tasks; None for an engine whose scheduler runs them."""
        return None

    def submitter(self, config: "JobConfig", *, out: IO[str], on_restart: Callable[[str], None] | None = None,
                  on_poll: Callable[[JobSubmitter], None] | None = None) -> JobSubmitter | None:
        """The job handed to a scheduler; None for an engine whose tasks the launcher loop starts."""
        return None

    def planned_tasks(self, config: "JobConfig") -> list[PlannedTask]:
        """The tasks a submitted job will have (the launcher loop lists its own as it starts them)."""
        return []
