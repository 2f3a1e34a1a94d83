"""One local job of the job service, in a process of its own: ``python -m tensorfleet.service.runner STORE JOB``.

The service starts a runner per local job, in a session of its own, and records it running with the
runner's pid; the runner is the job's engine (``backends/``: the launcher loop starts the tasks, restarts what
dies, stops them all) plus what the service needs from outside the process:

* it writes the job's state to the store itself (running -> succeeded | failed | stopped), so the
  outcome is recorded even while the service is down, and a restarted service re-attaches by pid;
* it says when it is ready for signals (``READY_FILE``): the service signals a stop only then (before,
  the stop request in the store is what the runner reads as it starts);
* every second it leaves the dashboard's picture in ``JOBDIR/picture.json`` (its job part alone in
  ``JOBDIR/progress.json``, what the jobs list reads), and in ``JOBDIR/tasks.json``
  every task the job has had, with the command and environment its process started with and whether a
  scale-down removed it (the job page reads both), counts task restarts into the store,
  and acts on what users asked through the store: a stop request, a new worker count.

Killing the service leaves runners running. Killing a runner kills its tasks (they die with their
launcher) and the service records the job lost. A failed job's reason names the task, how it ended and
the last traceback in its log, once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorfleet.errors import TensorfleetError
from tensorfleet.service.store import JobState, JobStore

if TYPE_CHECKING:
    from tensorfleet.backends.api import Engine
    from tensorfleet.backends.launcher import Launcher
    from tensorfleet.dashboard.picture import FleetPicture
    from tensorfleet.launch.config import JobConfig

MODULE = "tensorfleet.service.runner"
PICTURE_FILE = "picture.json"
PROGRESS_FILE = "progress.json"  # the picture's job part alone: what the jobs list reads of each job
READY_FILE = "runner.ready"  # written once SIGTERM is the runner's to handle: before it, a signal would kill it
TASKS_FILE = "tasks.json"
LAUNCHER_LOG = "launcher.log"
TICK_S = 1.0
CLAIM_WAIT_S = 30.0  # how long a new runner waits for the service to record it running
TRACEBACK_LINES = 40
PARSER_ERROR = re.compile(r"^[^\s:]+: error: \S")  # argparse's last line: "PROG: error: MESSAGE"


@dataclass(frozen=True)
class TaskEntry:
    """One task of a job as ``tasks.json`` keeps it: what its process was started with (the token never), and
    whether it was scaled away. The runner writes the list; the service reads it for the job page."""

    name: str  # "ps:0", "worker:1"
    role: str  # "ps", "chief", "worker"
    command: list[str]
    env: dict[str, str]
    removed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "command": list(self.command), "env": dict(self.env),
                "removed": self.removed}

    @classmethod
    def from_json(cls, value: Any) -> "TaskEntry":
        """An entry read back; ValueError naming what is wrong for one this version cannot read."""
        if not isinstance(value, dict):
            raise ValueError(f"a task entry is an object, not {type(value).__name__}")
        try:
            command, env = value["command"], value["env"]
            if not isinstance(command, list) or not isinstance(env, dict):
                raise TypeError("command is a list and env an object")
            return cls(str(value["name"]), str(value["role"]), [str(a) for a in command],
                       {str(k): str(v) for k, v in env.items()}, bool(value.get("removed", False)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"task entry {value.get('name')!r}: {exc!s}") from None


def write_tasks(path: Path, tasks: list[TaskEntry]) -> None:
    write_json(path, [task.to_json() for task in tasks])


def read_tasks(path: Path) -> list[TaskEntry]:
    """The entries of a ``tasks.json`` this version can read (none if the file is missing or not a list)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    entries = []
    for item in value if isinstance(value, list) else []:
        try:
            entries.append(TaskEntry.from_json(item))
        except ValueError:
            continue  # an entry another version wrote: the others still show
    return entries


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` atomically: a reader sees the old file or the new one, never half of one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(value), encoding="utf-8")
    os.replace(partial, path)


def write_picture(jobdir: Path, picture: FleetPicture) -> None:
    """Leave the job's picture (``PICTURE_FILE``, for its page) and its job part alone (``PROGRESS_FILE``): the
    jobs list reads a few hundred bytes per job, not a picture whose history holds up to 1,800 points (4.6 ms
    to read and parse each, 2.3 s for a list of 500 long jobs)."""
    shown = picture.to_json()
    write_json(jobdir / PICTURE_FILE, shown)
    write_json(jobdir / PROGRESS_FILE, {"job": shown["job"]})


def last_traceback(log: Path, limit: int = TRACEBACK_LINES) -> str | None:
    """The last Python traceback in a task's log (its last ``limit`` lines), or None."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    block = lines[starts[-1]:]
    end = next((i for i, line in enumerate(block[1:], 1) if line and not line.startswith(" ")), len(block) - 1)
    return "\n".join(block[:end + 1][-limit:])


def parser_error(log: Path, limit: int = TRACEBACK_LINES) -> str | None:
    """The script's argument parser refusing its flags at the end of a task's log (argparse's ``usage: ...``
    lines, then ``PROG: error: ...``, exit 2), or None: the reason a job failed without a traceback."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-limit:]
    except OSError:
        return None
    errors = [i for i, line in enumerate(lines) if PARSER_ERROR.match(line)]
    usages = [i for i, line in enumerate(lines[:errors[-1]] if errors else []) if line.startswith("usage: ")]
    return "\n".join(lines[usages[-1]:errors[-1] + 1]) if usages else None


def last_error(log: Path) -> str | None:
    """What a failed task's log ends with that says why: its last traceback, else its parser's refusal."""
    return last_traceback(log) or parser_error(log)


class JobRunner:
    """Runs job ``job_id`` of ``store`` on its engine (the launcher loop over the engine's starter, or the engine's
    submitter: a Slurm job), keeping the store and the job's folder current."""

    def __init__(self, store: JobStore, job_id: int) -> None:
        self.store = store
        self.job_id = job_id
        self.job = store.get(job_id)
        self._last_tick = 0.0
        self._restarts_counted = 0
        self._workers_target = self.job.workers_target
        self._tasks_written: tuple[int, int] | None = None  # (processes started, tasks in the fleet) then

    def wait_until_claimed(self) -> bool:
        """Wait for the service to record this process as the job's runner; False if it never does."""
        deadline = time.monotonic() + CLAIM_WAIT_S
        while time.monotonic() < deadline:
            self.job = self.store.get(self.job_id)
            if self.job.state is JobState.RUNNING:
                return self.job.pid == os.getpid() and self.job.logdir is not None
            if self.job.state is not JobState.STARTING:
                return False
            time.sleep(0.05)
        return False

    @property
    def jobdir(self) -> Path:
        """The job's folder (the service records it with the runner's pid)."""
        assert self.job.logdir is not None, "only a claimed runner has a folder"
        return Path(self.job.logdir)

    def run(self) -> int:
        from tensorfleet import backends  # after main() took SIGTERM over: see there
        from tensorfleet.backends.launcher import Launcher

        if self.store.get(self.job_id).stop_requested:  # asked before the tasks started: start none
            self._finish(JobState.STOPPED, f"stopped by {self.store.get(self.job_id).stop_requested} before it started")
            return 130
        config = self.job.job_config
        config.logdir = str(self.jobdir)
        config.dashboard = None
        config.env.setdefault("GRPC_VERBOSITY", "ERROR")
        config.backend = self.job.backend
        with open(self.jobdir / LAUNCHER_LOG, "a", encoding="utf-8", buffering=1) as out:
            try:
                engine = backends.load(config.backend)
                engine.for_service(config, dict(os.environ))
                if engine.submits:
                    return self._run_submitted(engine, config, out)
                engine.check(config)
                launcher = Launcher(config, engine.starter(config), out=out, interactive=False, on_tick=self._tick)
            except TensorfleetError as exc:
                out.write(f"[launch] cannot start: {exc}\n")
                self._finish(JobState.FAILED, f"cannot start: {exc}")
                return 1
            self._write_tasks(launcher)
            code = launcher.run()
            self._tick(launcher, force=True)
        self._finish(*self._outcome(launcher, code))
        return code

    def _run_submitted(self, engine: Engine, config: JobConfig, out: Any) -> int:
        """A job whose scheduler runs its tasks (the service's Slurm backend): submitted and followed
        (``backends/slurm.py``). The tasks' logs land in the job's folder as a local job's do; the picture is what
        the scheduler and those logs say (no live figures)."""
        try:
            engine.check(config)
            submitter = engine.submitter(config, out=out,
                                         on_restart=lambda line: self.store.count_restart(self.job_id, line),
                                         on_poll=lambda followed: write_picture(self.jobdir, followed.picture()))
            write_tasks(self.jobdir / TASKS_FILE, [TaskEntry(t.name, t.role, t.command, t.env)
                                                   for t in engine.planned_tasks(config)])
            code = submitter.run()
        except TensorfleetError as exc:
            out.write(f"[launch] cannot run on {engine.title}: {exc}\n")
            self._finish(JobState.FAILED, f"cannot run on {engine.title}: {exc}")
            return 1
        job = self.store.get(self.job_id)
        if job.stop_requested:
            self._finish(JobState.STOPPED, f"stopped by {job.stop_requested}")
        elif code == 0:
            self._finish(JobState.SUCCEEDED, "every worker finished")
        elif code == 130:
            self._finish(JobState.STOPPED, f"{engine.title} job {submitter.job_id} was cancelled")
        else:
            tracebacks = [t for t in (last_error(path) for path in sorted(self.jobdir.glob("*-*.log"))) if t]
            self._finish(JobState.FAILED, f"{engine.title} job {submitter.job_id} failed (see launcher.log)" +
                         (f"\n{tracebacks[0]}" if tracebacks else ""))
        return code

    # --- every second while the job runs -----------------------------------------------------

    def _tick(self, launcher: Launcher, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        if self._tasks_key(launcher) != self._tasks_written:  # before the picture: a task shown there is listed
            self._write_tasks(launcher)
        write_picture(self.jobdir, launcher.monitor.picture())
        restarts = [e for e in launcher.supervisor.events if e.event == "exited" and e.restart is not None]
        for event in restarts[self._restarts_counted:]:
            self.store.count_restart(self.job_id, f"{event.task} {event.how}; restart {event.restart} "
                                                  f"in {event.details['delay_s']:.0f} s")
        self._restarts_counted = len(restarts)
        job = self.store.get(self.job_id)
        if job.stop_requested and not force:
            signal.raise_signal(signal.SIGTERM)  # the launcher's own way to stop everything in order
        if job.workers_target is not None and job.workers_target != self._workers_target and not force:
            self._workers_target = job.workers_target
            try:
                launcher.scale_workers(job.workers_target)
                self.store.add_event(self.job_id, "scaled", f"now {job.workers_target} worker(s)")
            except TensorfleetError as exc:
                self.store.add_event(self.job_id, "scale-refused", str(exc))

    def _write_tasks(self, launcher: Launcher) -> None:
        """Every task the job has had: its current process's command and environment (as it was started: a
        scale changes the cluster, not what a running task was given), and ``removed`` once scaled away."""
        from tensorfleet.wire import auth
        current = {task.short for task in launcher.tasks}
        tasks = []
        for record in launcher.supervisor.records:
            env = launcher.started_with.get(record.name) or launcher.task_env(record.task)  # not started yet
            tasks.append(TaskEntry(record.name, record.role, list(launcher.command),
                                   {k: v for k, v in env.items() if k != auth.TOKEN_ENV},
                                   removed=record.name not in current))
        write_tasks(self.jobdir / TASKS_FILE, tasks)
        self._tasks_written = self._tasks_key(launcher)

    @staticmethod
    def _tasks_key(launcher: Launcher) -> tuple[int, int]:
        """What changes when tasks.json must: a process started (new env), or the fleet grew or shrank."""
        return launcher.spawns, len(launcher.tasks)

    # --- the end ------------------------------------------------------------------------------

    def _outcome(self, launcher: Launcher, code: int) -> tuple[JobState, str]:
        job = self.store.get(self.job_id)
        if job.stop_requested:
            return JobState.STOPPED, f"stopped by {job.stop_requested}"
        if code == 0:
            return JobState.SUCCEEDED, "every worker finished"
        if code == 130:
            return JobState.STOPPED, "its supervisor was stopped by a signal"
        for record in launcher.failed:
            event = next((e for e in reversed(launcher.supervisor.events)
                          if e.task == record.name and e.event == "failed"), None)
            reason = (f"{record.name} {event.how if event else 'failed'}; not restarted because "
                      f"{event.reason if event else 'its restart policy says so'}")
            traceback = last_error(launcher.log_path(record.task))
            return JobState.FAILED, reason + (f"\n{traceback}" if traceback else "")
        return JobState.FAILED, f"the launcher exited with code {code}"

    def _finish(self, state: JobState, reason: str) -> None:
        try:
            self.store.transition(self.job_id, state, expected=JobState.RUNNING, reason=reason)
        except TensorfleetError as exc:  # the service gave up on us meanwhile (lost): say so, change nothing
            print(f"[runner] could not record job {self.job_id} {state}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # A stop can come while this process still imports torch: until the launcher installs its own handler,
    # SIGTERM only wakes us (the stop request is in the store, and read before anything starts).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m {MODULE} STORE JOB_ID", file=sys.stderr)
        return 2
    with JobStore(argv[0]) as store:
        runner = JobRunner(store, int(argv[1]))
        if not runner.wait_until_claimed():
            print(f"[runner] job {argv[1]} was not recorded as run by pid {os.getpid()}; exiting", file=sys.stderr)
            return 1
        (runner.jobdir / READY_FILE).touch()
        return runner.run()


if __name__ == "__main__":
    sys.exit(main())
