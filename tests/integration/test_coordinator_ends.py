"""A coordinated job always ends (issue 42, items 3 and 4), driven in one process: a ps on 127.0.0.1, the
coordinator's session (the chief), and workers as threads, each with its own replica, session and closure server.

Before: a worker restarted after the coordinator's shutdown waited for a Done that had been said once, to its
dead predecessor, and the ps waited for that worker: the job never ended. In synchronous training a worker lost
in the middle of a closure ran the whole closure again, behind its partner: its last steps found no partner and
the job's end waited out the sync timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.coordinator import Coordinator
from tensorfleet.coordinator.remote import WorkerContext, worker_context
from tensorfleet.coordinator.worker import ClosureServer
from tensorfleet.cluster.ports import free_ports
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.testing.fleet import poll
from tensorfleet.train.session import TrainingSession
from tensorfleet.worker.replica import Replica

pytestmark = pytest.mark.cluster
SGD = OptimizerSpec.sgd(lr=1.0)
SYNC_TIMEOUT_S = 60.0  # what the end would wait out, before
STEPS = 6  # per closure


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))
        self.b = nn.Parameter(torch.zeros(()))


class Crash(Exception):
    """A worker process dies: its session ends without a Done."""


KILL: dict[str, object] = {}  # {"task": index, "after": steps, "server": the ClosureServer to kill}
DEAD = threading.Event()  # set at the end: the killed worker's closure may return (into nothing)


@tfl.remote
def ends_train_steps(count: int) -> int:
    context = worker_context()
    for step in range(count):
        victim = KILL.get("server")
        if victim is not None and KILL.get("task") == context.replica.task.index and step == KILL["after"] \
                and victim.context is context:
            KILL["killed"] = KILL.pop("server")
            victim.server.stop(0)  # killed mid-closure: the coordinator's call fails, the ps hears nothing more
            victim.finished.set()
            DEAD.wait(120)  # a dead process answers nothing: this call never returns while the test runs
            raise Crash("killed")
        context.session.run_step(lambda: context.model.a + context.model.b)
    return context.session.global_step


class Job:
    """1 ps, the coordinator's session (chief:0) and ``workers`` worker tasks; worker threads start on ``start``."""

    def __init__(self, workers: int, *, mode: str) -> None:
        ports = free_ports(2 + workers)
        self.cluster = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ports[0]}"], "chief": [f"127.0.0.1:{ports[1]}"],
                                              "worker": [f"127.0.0.1:{p}" for p in ports[2:]]})
        self.mode = mode
        self.sync = tfl.SyncOptions(replicas_to_aggregate=workers, timeout_s=SYNC_TIMEOUT_S) if mode == "sync" else None
        self.ps = Server(self.cluster, job_name="ps", task_index=0)
        self.servers: dict[int, ClosureServer] = {}
        self.threads: list[threading.Thread] = []
        self.coordinator: Coordinator | None = None
        chief = Replica(TwoScalars(), self.cluster, TaskSpec("chief", 0), optimizer=SGD, mode=mode, sync=self.sync)
        self.session = TrainingSession(chief, log_step_count_steps=None, summary_dir=False, recovery_timeout_s=30)
        self.session.__enter__()  # the chief initializes the ps

    def start(self, index: int) -> threading.Thread:
        """Start worker ``index`` (again: a new process, a new incarnation); return once it serves closures."""
        serving = threading.Event()

        def run() -> None:
            task = TaskSpec("worker", index)
            replica = Replica(TwoScalars(), self.cluster, task, optimizer=SGD, mode=self.mode, sync=self.sync)
            try:
                with TrainingSession(replica, log_step_count_steps=None, summary_dir=False,
                                     recovery_timeout_s=30) as session:
                    server = ClosureServer(self.cluster, task, WorkerContext(session=session))
                    self.servers[index] = server
                    serving.set()
                    server.serve()
                    if KILL.get("killed") is server:
                        raise Crash("killed")
            except Crash:
                pass  # as a SIGKILL: no Done

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        serving.wait(60)
        return thread

    def drive(self) -> Coordinator:
        self.coordinator = Coordinator(self.cluster, session=self.session)
        return self.coordinator

    def close(self) -> None:
        if self.coordinator is not None and not self.coordinator._stopping.is_set():  # a test that failed midway
            self.coordinator.shutdown(wait=False)
        for server in self.servers.values():
            server.finished.set()
        for thread in self.threads:
            thread.join(timeout=30)
        self.ps.stop(grace_s=0)


@pytest.fixture
def jobs():
    made: list[Job] = []
    DEAD.clear()
    yield lambda *args, **kwargs: made.append(Job(*args, **kwargs)) or made[-1]
    DEAD.set()
    KILL.clear()
    for job in made:
        job.close()


def test_a_worker_started_after_the_coordinator_ended_learns_the_job_is_done(jobs):
    job = jobs(2, mode="async")
    job.start(0)  # worker 1 is down the whole time the coordinator runs
    coordinator = job.drive()
    values = [coordinator.schedule(ends_train_steps, args=(2,)) for _ in range(3)]
    coordinator.join()
    assert all(v.worker == "/job:worker/task:0" for v in values)
    coordinator.shutdown()  # Done to worker 0; worker 1 does not answer it
    job.session.__exit__(None, None, None)  # the coordinator's Done to the ps: the job is over
    late = job.start(1)
    late.join(timeout=20)
    assert not late.is_alive(), "the worker started after the end still waits for a Done"
    assert job.ps.service.finished.wait(10)  # every replica said Done: the ps ends


def test_sync_a_worker_killed_mid_closure_skips_what_it_pushed_and_the_end_does_not_wait(jobs):
    job = jobs(2, mode="sync")
    job.start(0)
    job.start(1)
    coordinator = job.drive()
    KILL.update(task=1, after=3, server=job.servers[1])
    values = [coordinator.schedule(ends_train_steps, args=(STEPS,)) for _ in range(3)]
    poll(lambda: "server" not in KILL, 30, "worker 1 to be killed in its first closure")
    job.start(1)  # restarted: a new incarnation on the same address
    started = time.monotonic()
    results = [value.fetch(timeout_s=SYNC_TIMEOUT_S / 2) for value in values]  # before: the end waited it out
    assert time.monotonic() - started < SYNC_TIMEOUT_S / 2
    assert results[-1] == [3 * STEPS, 3 * STEPS]  # both replicas end at the same step: in step all along
    status = job.ps.service.store.status()
    assert status.global_step == 3 * STEPS and status.dropped_duplicate == 0 and status.dropped_stale == 0
    coordinator.shutdown()
    job.session.__exit__(None, None, None)
