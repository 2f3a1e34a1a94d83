"""Scaling a running asynchronous job's workers: the order of the steps, as a state machine.

No processes here (``local.py`` starts, signals and tells them, through the ``Fleet`` it is): this module
only decides, on each tick of the launcher's supervising loop (``Scaler.step``).  Worker indices stay
``0 .. N-1``, so the cluster (and the ``TF_CONFIG`` of every task started from now on) is always the
current fleet.  Up: new workers get new free ports; every ps is told the new count (``Resize``) and only
then do they start (their pushes and their Done must be accepted, and no ps may finish without them).
Down: the highest indices (never the chief) get the leave signal (``tensorfleet.worker.leave``), finish
their step, say Done and exit 0; once they are gone the cluster shrinks and every ps is told, which forgets
their Done, so that a later scale-up reuses their indices as new workers.  A ps that restarts meanwhile
starts from the current cluster, or is told again.  One change at a time:

    idle --(scale_to)--> telling the ps --(every ps knows the cluster's count)--> idle
                            |      ^                    (the added workers started, if any)
    (fewer workers: the     |      |  (every leaver gone:
     highest asked to leave)|      |   the cluster shrinks)
                            v      |
                      waiting for leavers

A newer count replaces one not reached yet: while the ps are told of a scale-up, fewer workers drop the
added ones not started; while leavers leave, the next change waits for them (a ps told of a scale-down
only after a scale-up that reuses the indices would count the new workers as done already).
"""

from __future__ import annotations

import signal
import time
from enum import Enum
from typing import Callable, Protocol

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, parse_address
from tensorfleet.errors import ConfigError
from tensorfleet.launch.monitor import task_role
from tensorfleet.launch.supervisor import Supervisor, TaskRecord
from tensorfleet.protocol.messages import MAX_REPLICAS

LEAVE_TIMEOUT_S = 60.0  # a worker asked to leave (scale-down) that is still there after this is stopped
RESIZE_RETRY_S = 1.0  # after a Resize that failed (a ps restarting), the next try


class ScaleState(Enum):
    """Where a scaling stands; every change starts from and returns to ``IDLE``."""

    IDLE = "idle"  # the cluster has the workers asked for, all started, and every ps knows their count
    TELLING_PS = "telling the ps"  # every ps is told the cluster's count (Resize) before the next step
    WAITING_FOR_LEAVERS = "waiting for leavers"  # workers asked to leave finish their step, say Done, exit


class Fleet(Protocol):
    """What the scaler asks of the launcher, which owns the processes (``backends/launcher.py``'s ``Launcher``)."""

    def start_worker(self, record: TaskRecord) -> None:
        """Start the process of a worker added to the cluster (its record is the supervisor's already)."""

    def signal_leave(self, name: str) -> bool:
        """Send the leave signal to the task's own process (tower 0, not its group); False if it is not running."""

    def signal_group(self, name: str, sig: int) -> None:
        """Send ``sig`` to the process group of the task (its towers too), if it has a process."""

    def resize_ps(self, record: TaskRecord, size: int) -> bool:
        """Tell a ps the job has ``size`` workers (Resize); False if it did not take it (unreachable, or
        every worker said Done: the job is ending)."""

    def fleet_changed(self) -> None:
        """The task list and the monitor follow the cluster (``Scaler.cluster``) now."""

    def say(self, line: str) -> None:
        """A line for the console."""

    def write_events(self) -> None:
        """Append the supervisor's new events to the job's event log."""


class Scaler:
    """Takes an asynchronous job from its worker count to the one asked for, one step per tick.

    Args:
        cluster: the job's cluster as it starts; the scaler's ``cluster`` is the current one from then on.
        supervisor: the task records (a scale-up adds to them, a scale-down marks workers leaving).
        fleet: what starts, signals and tells the tasks.
        free_ports: ``free_ports(count, host)``, the ports of added workers.
        kill_grace_s: how long after the SIGTERM of a leaver that outstayed ``LEAVE_TIMEOUT_S`` it is SIGKILLed.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, cluster: ClusterSpec, supervisor: Supervisor, fleet: Fleet, *,
                 free_ports: Callable[[int, str], list[int]], kill_grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.supervisor = supervisor
        self.fleet = fleet
        self.free_ports = free_ports
        self.kill_grace_s = kill_grace_s
        self.clock = clock
        self.state = ScaleState.IDLE
        self.target = cluster.num_tasks("worker")  # the worker count asked for
        self._unstarted: list[int] = []  # worker indices in the cluster, started once every ps knows the count
        self._leaving: dict[str, float] = {}  # workers asked to leave -> when (clock)
        self._terminated: set[str] = set()  # leavers that outstayed LEAVE_TIMEOUT_S and were sent SIGTERM
        self._ps_knows: dict[str, int] = {}  # ps task -> the worker count its incarnation started with or was told
        self._resize_after = 0.0  # no Resize before this (clock): the last one failed

    @property
    def workers(self) -> int:
        """The cluster's worker count (added workers not started yet included, leavers until they are gone)."""
        return self.cluster.num_tasks("worker")

    def started(self, record: TaskRecord) -> None:
        """A task's process starts from the current cluster: a ps knows the worker count of its ``TF_CONFIG``."""
        if record.role == "ps":
            self._ps_knows[record.name] = self.workers

    def check(self, workers: int) -> None:
        """Raise ``ConfigError`` unless the job can be scaled to ``workers`` now: a whole number the ps can
        take, and a chief still there (a job whose chief ended has no membership left to change)."""
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_REPLICAS:
            raise ConfigError(f"workers must be a whole number from 1 to {MAX_REPLICAS}, got {workers!r}")
        chief = self.supervisor.by_name[self.cluster.chief.short]
        if self.supervisor.stopping or chief.state not in ("starting", "running", "restarting"):
            raise ConfigError(f"the job is ending (its chief is {chief.state}): it can no longer be scaled")

    def scale_to(self, workers: int) -> None:
        """Ask for ``workers`` workers (as ``check`` accepts): record it, and take the first step now."""
        if workers == self.target:
            return
        before, self.target = self.target, workers
        self.supervisor.scaled(before, workers)
        self.fleet.write_events()
        self.fleet.say(f"[launch] scaling from {before} to {workers} worker(s)")
        if self.state is ScaleState.IDLE:
            self.state = ScaleState.TELLING_PS
        self.step()

    def step(self) -> None:
        """Every step towards ``target`` that can be taken now; called on every tick of the supervising loop.

        Every ps must know the cluster's current count before the next change (see the module docstring)."""
        if self.state is ScaleState.IDLE:
            return
        if self.state is ScaleState.WAITING_FOR_LEAVERS:
            if not self._leavers_gone():
                return
            self._set_workers(self.workers - len(self._leaving))
            self._leaving.clear()
            self._terminated.clear()
            self.fleet.fleet_changed()
            self.state = ScaleState.TELLING_PS
        size = self.workers
        if self.target < size and self._unstarted:  # fewer asked for before these even started
            keep = max(self.target, size - len(self._unstarted))
            self._unstarted = [i for i in self._unstarted if i < keep]
            self._set_workers(keep)
            size = keep
        if not self._every_ps_knows(size):
            return
        if not self._unstarted and self.target > size:
            self._unstarted = list(range(size, self.target))
            self._set_workers(self.target)
            if not self._every_ps_knows(self.target):
                return
        if self._unstarted:
            self._start_added_workers()
            # A larger count asked for meanwhile is the next change (its ps are told on the next tick).
            self.state = ScaleState.IDLE if self.target == self.workers else ScaleState.TELLING_PS
        elif self.target < size:
            self._ask_to_leave(range(size - 1, self.target - 1, -1))
            self.state = ScaleState.WAITING_FOR_LEAVERS
        else:
            self.state = ScaleState.IDLE

    def _set_workers(self, count: int) -> None:
        """The cluster with ``count`` workers: the first ones kept, new ones on new free ports."""
        jobs = self.cluster.as_dict()
        workers = jobs["worker"][:count]
        host = parse_address(workers[0])[0]
        used = {parse_address(address)[1] for addresses in jobs.values() for address in addresses}
        while len(workers) < count:
            for port in self.free_ports(count - len(workers), host):
                if port not in used:
                    used.add(port)
                    workers.append(f"{host}:{port}")
        self.cluster = ClusterSpec.from_dict({**jobs, "worker": workers})

    def _every_ps_knows(self, size: int) -> bool:
        """Tell every ps that does not know it yet that the job has ``size`` workers (Resize); True when all
        do.  A ps waiting for its restart will start from the current cluster; a finished one ends the job."""
        unknowing = [r for r in self.supervisor.records if r.role == "ps" and r.state != "restarting"
                     and self._ps_knows.get(r.name) != size]
        if not unknowing:
            return True
        if self.clock() < self._resize_after:
            return False
        for record in unknowing:
            if record.state != "running" or not self.fleet.resize_ps(record, size):
                self._resize_after = self.clock() + RESIZE_RETRY_S
                return False
            self._ps_knows[record.name] = size
        return True

    def _start_added_workers(self) -> None:
        for index in self._unstarted:
            task = TaskSpec("worker", index)
            record = TaskRecord(task, self.cluster.task_address("worker", index), task_role(self.cluster, task))
            self.supervisor.add(record)
            self.fleet.start_worker(record)
        self._unstarted = []
        self.fleet.fleet_changed()

    def _ask_to_leave(self, indices: range) -> None:
        """Scale down: these workers finish their step, say Done and exit (highest index first)."""
        now = self.clock()
        for index in indices:
            name = TaskSpec("worker", index).short
            self._leaving[name] = now
            if self.supervisor.leave(name) and self.fleet.signal_leave(name):
                self.fleet.say(f"[launch] {name} asked to leave: it finishes its step, says Done and exits")
        self.fleet.write_events()

    def _leavers_gone(self) -> bool:
        """True once every worker asked to leave has exited; one that outstays LEAVE_TIMEOUT_S is stopped."""
        now, gone = self.clock(), True
        for name, asked in self._leaving.items():
            if self.supervisor.by_name[name].pid is None:  # its exit was reaped (or it had no process)
                continue
            gone = False
            if now - asked >= LEAVE_TIMEOUT_S + self.kill_grace_s:
                self.fleet.signal_group(name, signal.SIGKILL)
            elif now - asked >= LEAVE_TIMEOUT_S and name not in self._terminated:
                self._terminated.add(name)
                self.fleet.say(f"[launch] {name} did not leave within {LEAVE_TIMEOUT_S:g} s (does its loop check "
                               "session.should_stop()?); stopping it")
                self.fleet.signal_group(name, signal.SIGTERM)
        return gone
