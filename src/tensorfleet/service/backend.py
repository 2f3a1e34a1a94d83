"""What the job service asks of a backend, the thing that actually runs a job (local processes, Kubernetes).

The service owns the store and the queue; a backend only runs, observes and stops one job at a
time, given its record. Every method may be called from any of the service's threads and after a
service restart (a backend keeps no state that a restart would lose: what it needs is in the record,
the job's folder, or the cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tensorfleet.dashboard.picture import FleetPicture, JobPicture
from tensorfleet.errors import TensorfleetError
from tensorfleet.service.store import JobRecord, JobState


class TaskNotFoundError(TensorfleetError):
    """The job has no such task (names are ``ps:0``, ``worker:1``, or ``launcher`` for a local job)."""

    code = "NOT_FOUND"


@dataclass(frozen=True)
class Observed:
    """A backend's view of an active job, for the service to record: ``state`` RUNNING while it runs,
    or the terminal state it reached (SUCCEEDED, FAILED, STOPPED, LOST) with the ``reason``."""

    state: JobState
    reason: str | None = None
    restarts: int | None = None  # task restarts so far, when the backend counts them


@dataclass(frozen=True)
class TaskView:
    """One task of a job as the job page shows it: how it was started, where its log is, what it does now."""

    name: str  # "ps:0", "worker:1"
    role: str  # "ps", "chief", "worker"
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # TF_CONFIG and the rest; never the job's secret token
    state: str = ""  # "running", "done", ... as its backend sees it; "removed": scaled away (its log stays)


@dataclass(frozen=True)
class LogChunk:
    """Text of a task's log from ``offset``; ``next_offset`` is where the next read starts."""

    text: str
    next_offset: int


class Backend:
    """Base of every backend: what the service asks of one. Each backend overrides what it does; the optional
    parts (``fits``, ``kill``, ``close``) and the two facts the service's rules read have defaults here, so the
    service asks every backend alike, by no name.

    ``on_this_machine``: its jobs' tasks share this machine's cores and GPUs, so the service admits a job when
    those hold it (else ``fits`` says). ``records_its_stop``: a stopped job is recorded by the job's own runner as
    it ends; else the service records it when ``stop`` returns.
    """

    name: str = ""  # "local", "kubernetes": the value of a job's ``backend`` setting
    on_this_machine: bool = False
    records_its_stop: bool = False

    def start(self, job: JobRecord, jobdir: Path) -> None:
        """Start ``job`` (state starting, claimed by this service); ``jobdir`` is its own folder. Returns once
        started; the job moves to running (pid recorded) by the backend or by ``observe``. Raises
        TensorfleetError when it cannot be started (the service records the job failed with that text)."""
        raise NotImplementedError

    def observe(self, job: JobRecord) -> Observed | None:
        """An active job's state now; None when the backend has nothing new to say (its runner writes the
        store itself)."""
        raise NotImplementedError

    def stop(self, job: JobRecord) -> None:
        """Ask an active job to stop (every process or pod gone when it is recorded stopped)."""
        raise NotImplementedError

    def scale(self, job: JobRecord, workers: int) -> None:
        """Ask a running async job to run ``workers`` workers. Raises ConfigError where not supported."""
        raise NotImplementedError

    def tasks(self, job: JobRecord) -> list[TaskView]:
        """The tasks of ``job`` with their command and environment, for the job page."""
        raise NotImplementedError

    def log(self, job: JobRecord, task: str, offset: int = 0, limit: int = 1 << 20) -> LogChunk:
        """At most ``limit`` bytes of ``task``'s output from ``offset``. Raises TaskNotFoundError."""
        raise NotImplementedError

    def picture(self, job: JobRecord) -> FleetPicture | None:
        """The job's latest dashboard picture, or None if there is none."""
        return None

    def progress(self, job: JobRecord) -> JobPicture | None:
        """The job part of its latest picture (what the jobs list shows of it), or None. By default the
        whole picture's; a backend that keeps the part on its own reads only that."""
        picture = self.picture(job)
        return picture.job if picture is not None else None

    def fits(self, job: JobRecord, active: Sequence[JobRecord]) -> bool:
        """Whether ``job`` may start now beside this backend's ``active`` jobs (not asked where
        ``on_this_machine``: the service counts this machine's cores). By default always: the scheduler queues."""
        return True

    def kill(self, job: JobRecord) -> bool:
        """Force a stop that did not happen in time; whether there was anything more to do than ``stop``."""
        return False

    def close(self) -> None:
        """The service is closing: let go of what the backend holds (a cluster connection); jobs run on."""
