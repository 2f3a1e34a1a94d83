"""The launcher's bookkeeping: every task's state, the restart policy, and the job's outcome.

No processes here (``local.py`` starts and watches them): this module only decides.
A task goes

    starting --(answers its Status RPC)--> running --(exit 0)--> done
        \\                                     |
         +------(exit != 0 or a signal)-------+--> restarting --(backoff elapsed)--> starting
                                              |
                                              +--> failed   (policy "never", restarts exhausted,
                                                             exit code 2: bad flags, or the same
                                                             non-zero exit twice in a row before
                                                             the task ever answered: a crash at
                                                             start-up, which a restart cannot help)

and every exit, restart and give-up is recorded as an event.  A worker removed by a
scale-down is *leaving* (``leave``): asked to finish its step and say Done, its exit ends
it whatever the code (0: done; else stopped, an exit the launcher asked for), it is
never restarted, and the job no longer waits for it.  Scaling itself is an event
(``scaled``, from and to, with no task), as is each worker asked to leave.  A crash at start-up is
retried once (it might have been the machine), not ``max_restarts`` times with growing
backoff: the same traceback four times over half a minute helps nobody.  The job
succeeds when every worker is done; a failed task fails the job (the others could only
wait for it).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from tensorfleet.cluster.spec import TaskSpec

STATES = ("starting", "running", "restarting", "done", "failed", "stopped")
RESTART_MODES = ("on-failure", "never")
USAGE_EXIT_CODE = 2  # argparse and run_task exit 2 for bad flags or TF_CONFIG: the same command fails again


class Decision(Enum):
    """What happens next to a task that exited: the answer of ``Supervisor.exited``, which the launcher acts on.

    A plain ``Enum``, not strings: a caller comparing with ``"restart"`` would be silently never true, so
    callers compare with the members.  (A task's *state* stays a string of ``STATES``: it goes to JSON.)
    """

    DONE = "done"  # exit 0: the task finished
    RESTART = "restart"  # start it again at its record's ``restart_at``
    FAILED = "failed"  # no restart: the job fails
    STOPPED = "stopped"  # the launcher is stopping everything: an exit it asked for


@dataclass(frozen=True)
class RestartPolicy:
    """When a task that died is started again: ``on-failure`` up to ``max_restarts`` times, or ``never``.

    The n-th restart of a task waits ``backoff_s * 2**(n-1)`` seconds, at most ``max_backoff_s``.
    """

    mode: str = "on-failure"
    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"restart={self.mode!r}: choose one of {', '.join(RESTART_MODES)}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be 0 or more")

    def delay(self, restart_number: int) -> float:
        return min(self.backoff_s * 2 ** (restart_number - 1), self.max_backoff_s)


@dataclass
class TaskRecord:
    """What the supervisor knows of one task across its incarnations."""

    task: TaskSpec
    address: str
    role: str  # "ps", "chief" or "worker"
    state: str = "starting"
    pid: int | None = None
    restarts: int = 0
    exit_code: int | None = None
    first_started: float | None = None
    last_started: float | None = None
    ended: float | None = None
    restart_at: float | None = None
    answered: bool = False  # this incarnation answered its Status at least once
    startup_exit: int | None = None  # the exit code of the last incarnation if it failed before answering
    leaving: bool = False  # removed by a scale-down: its exit ends it, it is not restarted
    outside: bool = False  # not the launcher's process: a coordinator that joins from a Python session
    # Set when the backend lost the process rather than saw it exit (a Ray node that died): its exit code is only
    # a stand-in, and this says what happened ("lost with its node (node id ...)") wherever the exit is told.
    lost: str | None = None

    @property
    def name(self) -> str:
        return self.task.short

    @property
    def how_ended(self) -> str:
        """The last exit in words: ``lost with its node (node id ...)``, ``exit code 1`` or ``killed by SIGKILL``."""
        if self.lost is not None:
            return self.lost
        return "-" if self.exit_code is None else describe_exit(self.exit_code)

    def wall_s(self, now: float) -> float:
        if self.first_started is None:
            return 0.0
        return (self.ended if self.ended is not None else now) - self.first_started


def describe_exit(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` (Popen reports a signal as a negative code)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def exit_label(code: int) -> str:
    """``1`` or ``SIGKILL``: an exit in one word, for tables."""
    return describe_exit(code).removeprefix("exit code ").removeprefix("killed by ")


@dataclass(frozen=True)
class TaskEvent:
    """One line of ``LOGDIR/events.jsonl``: at ``t`` seconds into the job, ``task`` (None: the job itself, a
    scale) had ``event`` ("started", "running", "exited", "failed", "stopped", "lost", "scaled", ...), with what
    that kind of event tells in ``details`` (``pid``, ``code``, ``how``, ``reason``, ``restart``, ``delay_s``,
    ``node``, ...)."""

    t: float
    task: str | None
    event: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def how(self) -> str | None:
        """How the task ended, in words ("exit code 1", "killed by SIGKILL", "lost with its node ...")."""
        return self.details.get("how")

    @property
    def reason(self) -> str | None:
        """Why it was not restarted (a "failed" event) or was stopped."""
        return self.details.get("reason")

    @property
    def restart(self) -> int | None:
        """The restart it will be, for an exit that is restarted (None: not restarted)."""
        return self.details.get("restart")

    def to_json(self) -> dict[str, Any]:
        """The line as events.jsonl keeps it: flat, the details beside t, task and event."""
        return {"t": self.t, "task": self.task, "event": self.event, **self.details}


@dataclass
class Supervisor:
    """Decides what happens to each task when it starts, answers, exits; keeps the event log.

    Args:
        records: one per task, in start order (ps first).
        policy: the restart policy of every task.
        clock: seconds, monotonic (tests pass a fake one).
    """

    records: Sequence[TaskRecord]
    policy: RestartPolicy = RestartPolicy()
    clock: Callable[[], float] = time.monotonic
    events: list[TaskEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = list(self.records)  # ours: a scale-up adds to it
        self.by_name = {record.name: record for record in self.records}
        self.started_at = self.clock()
        self.stopping = False
        # The launcher's loop reports starts and exits while the monitor's thread reports answers:
        # each transition is one step under this lock (an answer must not revive a task that just died).
        self._lock = threading.RLock()

    def _event(self, record: TaskRecord | None, kind: str, **details: Any) -> TaskEvent:
        event = TaskEvent(round(self.clock() - self.started_at, 3), record.name if record else None, kind, details)
        self.events.append(event)
        return event

    def started(self, name: str, pid: int, **where: Any) -> None:
        """Task ``name`` started as process ``pid``; ``where``: more about where it runs, for its event (a Ray
        node)."""
        with self._lock:
            record = self.by_name[name]
            now = self.clock()
            record.state, record.pid, record.exit_code, record.restart_at = "starting", pid, None, None
            record.answered, record.lost = False, None
            record.last_started = now
            if record.first_started is None:
                record.first_started = now
            self._event(record, "started", pid=pid, incarnation=record.restarts, **where)

    def awaited(self, name: str, **where: Any) -> None:
        """Task ``name`` is not the launcher's to start (``outside``): it is expected from now on, and is
        running once it answers its Status."""
        with self._lock:
            record = self.by_name[name]
            record.state, record.last_started = "starting", self.clock()
            record.first_started = record.first_started or record.last_started
            self._event(record, "awaited", **where)

    def joined_done(self, name: str) -> None:
        """Task ``name``, ``outside``, is done: the ps heard it say Done and exited."""
        with self._lock:
            record = self.by_name[name]
            record.state, record.ended = "done", self.clock()
            self._event(record, "done")

    def answered(self, name: str, since: float) -> None:
        """The task answered its Status RPC at ``since`` (clock time): a starting task is now running."""
        with self._lock:
            record = self.by_name[name]
            if record.state == "starting" and record.last_started is not None and since >= record.last_started:
                record.state, record.answered, record.startup_exit = "running", True, None
                self._event(record, "running")

    def lost(self, name: str, how: str) -> None:
        """The backend lost task ``name``'s process (its node died): its coming exit is told as ``how``."""
        with self._lock:
            self.by_name[name].lost = how

    def exited(self, name: str, code: int) -> Decision:
        """Record an exit; return what happens next: ``DONE``, ``RESTART`` (at ``restart_at``), ``FAILED``
        or ``STOPPED``."""
        with self._lock:
            record = self.by_name[name]
            now = self.clock()
            record.exit_code, record.pid = code, None
            if record.leaving and code != 0:  # scaled away: no restart, and not a failure of the job
                record.state, record.ended = "stopped", now
                self._event(record, "stopped", code=code, how=record.how_ended, reason="it was leaving the job")
                return Decision.STOPPED
            if code == 0:
                record.state, record.ended = "done", now
                self._event(record, "exited", code=code)
                return Decision.DONE
            if self.stopping:
                record.state, record.ended = "stopped", now
                self._event(record, "stopped", code=code)
                return Decision.STOPPED
            why = self._no_restart_reason(record, code)
            record.startup_exit = code if code > 0 and not record.answered else None
            if why is None:
                record.restarts += 1
                delay = self.policy.delay(record.restarts)
                record.state, record.restart_at = "restarting", now + delay
                self._event(record, "exited", code=code, how=record.how_ended, restart=record.restarts,
                            delay_s=delay)
                return Decision.RESTART
            record.state, record.ended = "failed", now
            self._event(record, "failed", code=code, how=record.how_ended, reason=why)
            return Decision.FAILED

    def gave_up(self, name: str, reason: str) -> None:
        """Task ``name``, waiting for its restart, cannot be started again (no node takes it): it fails, and so
        does the job, with ``reason``."""
        with self._lock:
            record = self.by_name[name]
            record.state, record.ended, record.restart_at = "failed", self.clock(), None
            self._event(record, "failed", code=record.exit_code, how=record.how_ended, reason=reason)

    def _no_restart_reason(self, record: TaskRecord, code: int) -> str | None:
        if self.policy.mode == "never":
            return "the restart policy is 'never'"
        if code == USAGE_EXIT_CODE:
            return "exit code 2 means bad flags or configuration, which a restart cannot fix"
        if code > 0 and not record.answered and record.startup_exit == code:
            return (f"it exited with code {code} at start-up twice in a row, before it ever answered: "
                    "a crash that a restart does not fix")
        if record.restarts >= self.policy.max_restarts:
            return f"it was already restarted {record.restarts} time(s) (--max-restarts {self.policy.max_restarts})"
        return None

    # --- scaling --------------------------------------------------------------------------------

    def scaled(self, before: int, after: int) -> None:
        """The job's worker count goes from ``before`` to ``after`` (an event of the job, not of a task)."""
        with self._lock:
            self._event(None, "scaled", **{"from": before, "to": after})

    def add(self, record: TaskRecord) -> None:
        """A worker added by a scale-up, to be started now; it takes the place of an earlier record of the
        same name (a worker that left)."""
        with self._lock:
            old = self.by_name.get(record.name)
            if old is not None and old.state in ("starting", "running", "restarting"):
                raise ValueError(f"{record.name} is still {old.state}: it cannot be added again")
            if old is None:
                self.records.append(record)
            else:
                self.records[self.records.index(old)] = record
            self.by_name[record.name] = record

    def leave(self, name: str) -> bool:
        """A scale-down removes this worker; return whether it has a process to ask (else it is stopped now:
        it was waiting for a restart)."""
        with self._lock:
            record = self.by_name[name]
            record.leaving = True
            self._event(record, "leaving")
            if record.state == "restarting":
                record.state, record.ended, record.restart_at = "stopped", self.clock(), None
                self._event(record, "stopped", reason="it was leaving the job")
            return record.state in ("starting", "running")

    def due(self) -> list[TaskRecord]:
        """Tasks whose restart backoff has elapsed, to be started again now."""
        now = self.clock()
        return [r for r in self.records if r.state == "restarting" and r.restart_at is not None and r.restart_at <= now]

    @property
    def workers(self) -> list[TaskRecord]:
        """The training tasks the job waits for: not the ones leaving (or gone) by a scale-down."""
        return [r for r in self.records if r.role != "ps" and not r.leaving and not r.outside]

    def workers_done(self) -> bool:
        """Every worker is done, and none that is leaving still runs (it is saying Done to the ps)."""
        return (all(r.state == "done" for r in self.workers)
                and not any(r.leaving and r.state in ("starting", "running") for r in self.records))

    def crashed_at_startup(self, name: str) -> bool:
        """The task's last exit was non-zero before it ever answered its Status."""
        return self.by_name[name].startup_exit is not None

    def failed(self) -> list[TaskRecord]:
        return [r for r in self.records if r.state == "failed"]

    def stop_all(self) -> None:
        """From now on an exit is a stop we asked for, not a failure to restart."""
        with self._lock:
            self.stopping = True
            now = self.clock()
            for record in self.records:
                if record.state == "restarting":
                    record.state, record.ended, record.restart_at = "stopped", now, None

    @property
    def total_restarts(self) -> int:
        return sum(r.restarts for r in self.records)

    def summary_table(self) -> str:
        """One row per task: state, exit, restarts and wall time, for the end of the job."""
        now = self.clock()
        rows = [("task", "role", "state", "exit", "restarts", "wall time")]
        for r in self.records:
            exit_text = "lost" if r.lost is not None else "-" if r.exit_code is None else exit_label(r.exit_code)
            rows.append((r.name, r.role, r.state, exit_text, str(r.restarts), f"{r.wall_s(now):.1f} s"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(line.rstrip() for line in lines)
