"""The local backend: each job is a runner process (``service/runner.py``) on this machine.

The runner writes the job's state to the store itself; this backend starts it (detached, in a
session of its own, so that it outlives the service), recognises it again after a service restart
(its pid, checked against the runner's command line, since pids are reused), signals it to stop,
and reads what it leaves in the job's folder: task logs, the dashboard picture, the tasks' commands.

A task scaled away stays a task of the job: the runner lists it ``removed`` in ``tasks.json`` (each task
with the environment its process was started with), and its log stays readable, as does every task
log in the job's folder (a runner of an older version listed only the tasks of the moment).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tensorfleet.dashboard.picture import FleetPicture, JobPicture
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.service.backend import Backend, LogChunk, Observed, TaskNotFoundError, TaskView
from tensorfleet.service.runner import (LAUNCHER_LOG, MODULE, PICTURE_FILE, PROGRESS_FILE, READY_FILE, TASKS_FILE,
                                       read_tasks)
from tensorfleet.service.store import ACTIVE, JobRecord, JobState, JobStore

LAUNCHER_TASK = "launcher"  # the pseudo-task whose log is the runner's own output
TASK_NAME = re.compile(r"^(ps|worker):\d{1,4}$")  # what a task may be called before the runner lists them
TASK_LOG = re.compile(r"^(ps|worker)-(\d{1,4})\.log$")  # a task's log in the job's folder (Launcher.log_path)
REMOVED = "removed"  # the state of a task scaled away


def runner_command(store_path: Path, job_id: int) -> list[str]:
    return [sys.executable, "-m", MODULE, str(store_path), str(job_id)]


def process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``Z``: exited, not yet reaped by its parent); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_runner(pid: int, store_path: Path, job_id: int) -> bool:
    """Whether ``pid`` is alive and is the runner of ``job_id`` (not a process that reused its pid)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if process_state(pid) in (None, "Z"):
        return False
    argv = raw.decode(errors="replace").split("\0")
    return MODULE in argv and str(store_path) in argv and str(job_id) in argv


class LocalBackend(Backend):
    """Runs jobs as runner processes; ``store`` is the service's, ``store_path`` what runners open."""

    name = "local"
    on_this_machine = True  # its tasks share this machine's cores: the service admits by them
    records_its_stop = True  # the runner records "stopped" as it ends

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._children: dict[int, subprocess.Popen] = {}  # runners this service started: reaped by poll()
        self._lock = threading.Lock()

    def runner_env(self) -> dict[str, str]:
        """What a runner gets on top of the service's environment (another backend's settings)."""
        return {}

    def start(self, job: JobRecord, jobdir: Path) -> None:
        with open(jobdir / LAUNCHER_LOG, "ab") as log:
            process = subprocess.Popen(runner_command(self.store.path, job.id), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=jobdir, env={**os.environ, **self.runner_env()})
        with self._lock:
            self._children[process.pid] = process
        try:
            self.store.transition(job.id, JobState.RUNNING, expected=JobState.STARTING, pid=process.pid,
                                  logdir=str(jobdir))
        except TensorfleetError:
            _signal(process.pid, signal.SIGKILL)  # stopped meanwhile: the runner never saw itself claimed
            raise

    def alive(self, job: JobRecord) -> bool:
        if job.pid is None:
            return False
        with self._lock:
            child = self._children.get(job.pid)
            if child is not None and child.poll() is not None:
                del self._children[job.pid]
                return False
        return is_runner(job.pid, self.store.path, job.id)

    def observe(self, job: JobRecord) -> Observed | None:
        if job.pid is None:  # claimed, never started: only seen so by a service that restarted in between
            return Observed(JobState.LOST, "the service stopped before the job's supervisor was started")
        if self.alive(job):
            return None
        current = self.store.get(job.id)  # the runner may have recorded its outcome just before exiting
        if current.state not in ACTIVE:
            return None
        return Observed(JobState.LOST, f"its supervisor (pid {job.pid}) exited without recording an outcome "
                                       f"(killed?); see the launcher log")

    def stop(self, job: JobRecord) -> None:
        """SIGTERM the runner once it is ready for it; before, it reads the stop request as it starts."""
        if job.pid is not None and job.logdir and (Path(job.logdir) / READY_FILE).exists() and self.alive(job):
            _signal(job.pid, signal.SIGTERM)

    def kill(self, job: JobRecord) -> bool:
        """The runner did not stop in time: SIGKILL it (its tasks die with it)."""
        if job.pid is not None and self.alive(job):
            _signal(job.pid, signal.SIGKILL)
        return True

    def scale(self, job: JobRecord, workers: int) -> None:
        if job.config.get("mode") != "async":
            raise ConfigError("only an asynchronous job can be scaled (sync training aggregates a fixed number "
                              "of replicas): restart it with other settings instead")
        # The runner reads the target from the store (the service has written it) on its next tick.

    def tasks(self, job: JobRecord) -> list[TaskView]:
        """Every task the job has had, ps first, each with what its process was started with and its state
        now (from the picture; ``removed`` for one scaled away, and for a task log no list names)."""
        if not job.logdir:
            return []
        jobdir = Path(job.logdir)
        states = {t.name: t.state or "" for t in FleetPicture.read(_read_json(jobdir / PICTURE_FILE)).tasks}
        views: dict[str, TaskView] = {}
        for t in read_tasks(jobdir / TASKS_FILE):  # entries this version cannot read are left out
            views[t.name] = TaskView(t.name, t.role, t.command, t.env, REMOVED if t.removed else states.get(t.name, ""))
        try:
            logs = [TASK_LOG.match(path.name) for path in jobdir.iterdir()]
        except OSError:
            logs = []
        for match in filter(None, logs):
            name = f"{match[1]}:{int(match[2])}"
            views.setdefault(name, TaskView(name, match[1], [], {}, REMOVED))
        return sorted(views.values(), key=_task_order)

    def log(self, job: JobRecord, task: str, offset: int = 0, limit: int = 1 << 20) -> LogChunk:
        listed = {t.name for t in self.tasks(job)}
        if task != LAUNCHER_TASK and task not in listed and (listed or not TASK_NAME.match(task)):
            raise TaskNotFoundError(f"job {job.id} has no task {task!r}; its tasks: "
                                    f"{', '.join(sorted(listed | {LAUNCHER_TASK}))}")
        if job.logdir is None:  # queued: nothing written yet
            return LogChunk("", offset)
        path = Path(job.logdir) / (LAUNCHER_LOG if task == LAUNCHER_TASK else f"{task.replace(':', '-')}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, offset))
                data = f.read(limit)
        except FileNotFoundError:
            return LogChunk("", offset)
        if len(data) == limit:
            data = _whole_characters(data)  # an incomplete character waits for the next read
        return LogChunk(data.decode("utf-8", errors="replace"), offset + len(data))

    def picture(self, job: JobRecord) -> FleetPicture | None:
        """The picture the job's runner left last (None before its first)."""
        found = _read_json(Path(job.logdir) / PICTURE_FILE) if job.logdir else None
        return FleetPicture.read(found) if found is not None else None

    def progress(self, job: JobRecord) -> JobPicture | None:
        """The job part its runner left last (``PROGRESS_FILE``); for a job run before that file existed, its
        picture's."""
        found = _read_json(Path(job.logdir) / PROGRESS_FILE) if job.logdir else None
        return FleetPicture.read(found).job if found is not None else super().progress(job)


def _whole_characters(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut off at its end."""
    for i in range(len(data) - 1, max(len(data) - 4, -1), -1):
        byte = data[i]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the character's first byte
            continue
        needed = 1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return data[:i] if len(data) - i < needed else data
    return data


def _task_order(task: TaskView) -> tuple[int, int, str]:
    """ps before workers, each by index (``worker:10`` after ``worker:9``)."""
    kind, _, index = task.name.partition(":")
    return (0 if kind == "ps" else 1, int(index) if index.isdigit() else 0, task.name)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
