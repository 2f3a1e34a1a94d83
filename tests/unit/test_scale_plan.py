"""Scaling without processes: what scale_workers refuses, and the Scaler's steps and states on each tick.

The Scaler is driven through a stand-in for the launcher (its ``Fleet``): the test plays the tasks (they
start, answer, exit), the ps (it takes a Resize, or does not) and the clock, and checks what the scaler
asks for and which state it is in after each tick.
"""

from __future__ import annotations

import io
import signal
from types import SimpleNamespace

import pytest

from tensorfleet.backends.launcher import Launcher
from tensorfleet.backends.local import local_launcher
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.launch.monitor import fleet_tasks, task_role
from tensorfleet.launch.scaling import LEAVE_TIMEOUT_S, RESIZE_RETRY_S, Scaler, ScaleState
from tensorfleet.launch.supervisor import Decision, RestartPolicy, Supervisor, TaskRecord

PORT = 23000  # consecutive ports: nothing is bound to find free ones
KILL_GRACE_S = 5.0
IDLE, TELLING_PS, WAITING_FOR_LEAVERS = ScaleState.IDLE, ScaleState.TELLING_PS, ScaleState.WAITING_FOR_LEAVERS


def make_launcher(**fields) -> Launcher:
    config = JobConfig(script="job.py", ps=1, workers=2, port=PORT, **fields)
    return local_launcher(config, out=io.StringIO(), interactive=False)


@pytest.mark.parametrize("mode", ["sync", None])
def test_only_an_async_job_can_be_scaled(mode):
    launcher = make_launcher(mode=mode)
    with pytest.raises(ConfigError, match=r"needs an asynchronous job \(--async\).*fixed number"):
        launcher.scale_workers(3)
    assert launcher.scaler.target == 2 and launcher.supervisor.events == []
    launcher.monitor.stop()


@pytest.mark.parametrize("workers", [0, -1, True, 2.0, "3"])
def test_the_worker_count_must_be_a_whole_number_from_one(workers):
    launcher = make_launcher(mode="async")
    with pytest.raises(ConfigError, match="workers must be a whole number from 1"):
        launcher.scale_workers(workers)
    launcher.monitor.stop()


def test_workers_with_towers_can_grow_but_not_leave():
    launcher = make_launcher(mode="async", env={"TENSORFLEET_TOWERS": "2"})
    with pytest.raises(ConfigError, match="towers"):
        launcher.scale_workers(1)
    launcher.monitor.stop()


def test_the_launcher_is_the_scalers_fleet_and_its_views_follow_the_cluster(monkeypatch):
    launcher = make_launcher(mode="async")
    started, resized = [], []

    def spawn(record: TaskRecord) -> None:
        launcher.scaler.started(record)
        launcher.supervisor.started(record.name, 1000 + len(started))
        launcher.supervisor.answered(record.name, since=launcher.supervisor.by_name[record.name].last_started)
        started.append(record.name)

    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "resize_ps", lambda record, size: resized.append(size) or True)
    launcher.scaler.free_ports = lambda count, host: [PORT + 100 + i for i in range(count)]
    for record in launcher.supervisor.records:
        spawn(record)
    launcher.scale_workers(3)
    assert resized == [3] and started[-1] == "worker:2"
    assert launcher.cluster is launcher.scaler.cluster and launcher.cluster.num_tasks("worker") == 3
    assert [t.short for t in launcher.tasks] == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert [t.short for t in launcher.monitor.tasks] == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert launcher.cluster.as_dict()["worker"][2] in launcher.task_env(TaskSpec("ps", 0))["TF_CONFIG"]
    launcher.monitor.stop()


class FakeFleet:
    """Stands in for the launcher: records what the scaler starts, signals and tells; plays the clock."""

    def __init__(self, workers: int = 2) -> None:
        cluster = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{PORT}"],
                                         "worker": [f"127.0.0.1:{PORT + 1 + i}" for i in range(workers)]})
        records = [TaskRecord(t, cluster.task_address(t.job_name, t.index), task_role(cluster, t))
                   for t in fleet_tasks(cluster)]
        self.now = 0.0
        self.supervisor = Supervisor(records, RestartPolicy(), clock=lambda: self.now)
        ports = iter(range(PORT + 100, PORT + 200))
        self.scaler = Scaler(cluster, self.supervisor, self, kill_grace_s=KILL_GRACE_S, clock=lambda: self.now,
                             free_ports=lambda count, host: [next(ports) for _ in range(count)])
        self.tasks = fleet_tasks(cluster)
        self.started: list[str] = []
        self.asked_to_leave: list[str] = []
        self.group_signals: list[tuple[str, str]] = []
        self.resized: list[int] = []
        self.said: list[str] = []
        self.ps_takes_resize = True
        self.processes: dict[str, SimpleNamespace] = {}
        self._pids = iter(range(1000, 2000))
        for record in records:
            self.start_worker(record)
            self.supervisor.answered(record.name, since=record.last_started)
        self.started.clear()

    # --- the Fleet --------------------------------------------------------------------------------

    def start_worker(self, record: TaskRecord) -> None:
        self.scaler.started(record)
        pid = next(self._pids)
        self.processes[record.name] = SimpleNamespace(pid=pid)
        self.supervisor.started(record.name, pid)
        self.started.append(record.name)

    def signal_leave(self, name: str) -> bool:
        if name not in self.processes:
            return False
        self.asked_to_leave.append(name)
        return True

    def signal_group(self, name: str, sig: int) -> None:
        self.group_signals.append((name, signal.Signals(sig).name))

    def resize_ps(self, record: TaskRecord, size: int) -> bool:
        self.resized.append(size)
        return self.ps_takes_resize

    def fleet_changed(self) -> None:
        self.tasks = fleet_tasks(self.scaler.cluster)

    def say(self, line: str) -> None:
        self.said.append(line)

    def write_events(self) -> None:
        pass

    # --- the test's moves -------------------------------------------------------------------------

    def answer(self, name: str) -> None:
        self.supervisor.answered(name, since=self.supervisor.by_name[name].last_started)

    def exit(self, name: str, code: int) -> Decision:
        del self.processes[name]
        return self.supervisor.exited(name, code)

    def tick(self) -> None:
        self.now += RESIZE_RETRY_S  # a failed Resize may be tried again
        self.scaler.step()

    @property
    def workers(self) -> list[str]:
        return self.scaler.cluster.as_dict()["worker"]

    @property
    def task_names(self) -> list[str]:
        return [t.short for t in self.tasks]


@pytest.fixture
def fleet() -> FakeFleet:
    return FakeFleet()


def test_scale_up_tells_every_ps_before_the_new_worker_starts(fleet):
    scaler = fleet.scaler
    assert scaler.state is IDLE
    fleet.ps_takes_resize = False  # ps:0 is busy: nothing may start yet
    scaler.scale_to(3)
    assert fleet.resized == [3] and fleet.started == [] and scaler.state is TELLING_PS
    assert len(fleet.workers) == 3  # a ps restarting now would start with the new count
    assert fleet.task_names == ["ps:0", "worker:0", "worker:1"]  # not a task before it starts
    scaler.step()
    assert fleet.resized == [3]  # no Resize again before RESIZE_RETRY_S
    fleet.ps_takes_resize = True
    fleet.tick()
    assert fleet.resized == [3, 3] and fleet.started == ["worker:2"] and scaler.state is IDLE
    assert fleet.workers[2] == f"127.0.0.1:{PORT + 100}"  # a new free port
    assert fleet.task_names == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert fleet.supervisor.events[-2].event == "scaled" and fleet.supervisor.events[-2].task is None
    assert (fleet.supervisor.events[-2].details["from"], fleet.supervisor.events[-2].details["to"]) == (2, 3)
    fleet.ps_takes_resize = False
    fleet.tick()
    assert fleet.resized == [3, 3] and scaler.state is IDLE  # idle: nothing asked of anyone


def test_scale_down_asks_the_highest_workers_to_leave_and_shrinks_once_they_are_gone(fleet):
    scaler = fleet.scaler
    scaler.scale_to(3)
    fleet.answer("worker:2")
    scaler.scale_to(1)
    assert fleet.asked_to_leave == ["worker:2", "worker:1"]  # never worker:0, the chief
    assert scaler.state is WAITING_FOR_LEAVERS and not fleet.supervisor.workers_done()
    assert fleet.exit("worker:2", 0) is Decision.DONE
    fleet.tick()
    assert len(fleet.workers) == 3 and fleet.resized == [3]  # worker:1 is still saying Done
    assert scaler.state is WAITING_FOR_LEAVERS
    # One that dies of the signal (a loop without TrainingSession) is stopped, not restarted nor failed.
    assert fleet.exit("worker:1", -10) is Decision.STOPPED
    assert fleet.supervisor.by_name["worker:1"].state == "stopped" and fleet.supervisor.failed() == []
    fleet.tick()
    assert len(fleet.workers) == 1 and fleet.resized == [3, 1] and scaler.state is IDLE
    assert fleet.task_names == ["ps:0", "worker:0"]
    assert fleet.supervisor.by_name["worker:2"].state == "done"  # kept for the summary
    assert not fleet.supervisor.workers_done()  # worker:0 still trains
    fleet.exit("worker:0", 0)
    assert fleet.supervisor.workers_done()


def test_a_scale_up_after_a_scale_down_waits_until_every_ps_knows_the_shrink(fleet):
    """Otherwise a ps told 3 -> 2 instead of 3 -> 1 -> 2 would count the returning worker:1's old Done."""
    scaler = fleet.scaler
    scaler.scale_to(3)
    scaler.scale_to(1)
    scaler.scale_to(2)  # before the leavers are even gone: the newest count wins
    assert fleet.asked_to_leave == ["worker:2", "worker:1"] and scaler.state is WAITING_FOR_LEAVERS
    fleet.exit("worker:2", 0)
    fleet.exit("worker:1", 0)
    fleet.ps_takes_resize = False
    fleet.tick()
    assert fleet.resized == [3, 1] and len(fleet.workers) == 1 and fleet.started == ["worker:2"]
    assert scaler.state is TELLING_PS
    fleet.ps_takes_resize = True
    fleet.tick()
    assert fleet.resized == [3, 1, 1, 2] and fleet.started == ["worker:2", "worker:1"] and scaler.state is IDLE
    record = fleet.supervisor.by_name["worker:1"]
    assert (record.state, record.leaving, record.restarts) == ("starting", False, 0)  # a new worker
    assert fleet.supervisor.records.count(record) == 1 and len(fleet.supervisor.records) == 4
    assert fleet.workers[1] != f"127.0.0.1:{PORT + 2}"  # a new port, not the one it left


def test_a_larger_count_asked_while_the_ps_are_told_is_the_next_change(fleet):
    scaler = fleet.scaler
    fleet.ps_takes_resize = False
    scaler.scale_to(3)
    scaler.scale_to(4)  # worker:2 is not started yet: it starts first, then the ps are told of 4
    fleet.ps_takes_resize = True
    fleet.tick()
    assert fleet.started == ["worker:2"] and len(fleet.workers) == 3 and scaler.state is TELLING_PS
    fleet.tick()
    assert fleet.started == ["worker:2", "worker:3"] and fleet.resized == [3, 3, 4] and scaler.state is IDLE


def test_fewer_workers_asked_before_the_added_ones_started_drop_them(fleet):
    scaler = fleet.scaler
    fleet.ps_takes_resize = False
    scaler.scale_to(4)
    assert len(fleet.workers) == 4 and scaler.state is TELLING_PS
    scaler.scale_to(3)
    assert len(fleet.workers) == 3 and scaler.state is TELLING_PS  # worker:3 dropped, worker:2 still to start
    scaler.scale_to(1)  # below the count the ps know: the added ones go, then the highest leave
    assert len(fleet.workers) == 2 and fleet.started == [] and fleet.resized == [4]
    assert fleet.asked_to_leave == ["worker:1"] and scaler.state is WAITING_FOR_LEAVERS


def test_a_worker_waiting_for_its_restart_leaves_at_once(fleet):
    assert fleet.exit("worker:1", 1) is Decision.RESTART
    fleet.scaler.scale_to(1)
    assert fleet.asked_to_leave == [] and fleet.scaler.state is WAITING_FOR_LEAVERS
    assert fleet.supervisor.by_name["worker:1"].state == "stopped"
    assert fleet.supervisor.due() == []
    fleet.tick()
    assert len(fleet.workers) == 1 and fleet.resized == [1] and fleet.scaler.state is IDLE


def test_a_leaver_that_outstays_the_timeout_is_stopped_then_killed(fleet):
    scaler = fleet.scaler
    scaler.scale_to(1)
    fleet.now += LEAVE_TIMEOUT_S - 0.1
    scaler.step()
    assert fleet.group_signals == [] and scaler.state is WAITING_FOR_LEAVERS
    fleet.now += 0.1
    scaler.step()
    scaler.step()
    assert fleet.group_signals == [("worker:1", "SIGTERM")]  # once
    assert "worker:1 did not leave within 60 s" in fleet.said[-1]
    fleet.now += KILL_GRACE_S
    scaler.step()
    assert fleet.group_signals == [("worker:1", "SIGTERM"), ("worker:1", "SIGKILL")]
    assert len(fleet.workers) == 2 and fleet.resized == []  # not gone until its exit is reaped
    assert fleet.exit("worker:1", -9) is Decision.STOPPED
    scaler.step()
    assert len(fleet.workers) == 1 and fleet.resized == [1] and scaler.state is IDLE


def test_a_ps_waiting_for_its_restart_is_not_asked_and_one_starting_is_asked_once_it_answers(fleet):
    scaler = fleet.scaler
    fleet.ps_takes_resize = False
    scaler.scale_to(3)
    assert fleet.exit("ps:0", 1) is Decision.RESTART
    fleet.tick()  # it will start from the cluster of 3 workers
    assert fleet.resized == [3] and fleet.started == ["worker:2"] and scaler.state is IDLE
    fleet.start_worker(fleet.supervisor.by_name["ps:0"])
    fleet.tick()
    assert fleet.resized == [3] and scaler.state is IDLE  # it knows 3 from its TF_CONFIG
    fleet.ps_takes_resize = True
    scaler.scale_to(4)  # ps:0 has not answered yet: not asked, nothing starts
    assert fleet.resized == [3] and fleet.started == ["worker:2", "ps:0"] and scaler.state is TELLING_PS
    fleet.answer("ps:0")
    fleet.tick()
    assert fleet.resized == [3, 4] and fleet.started[-1] == "worker:3" and scaler.state is IDLE


def test_the_count_must_be_a_whole_number_and_the_chief_still_there(fleet):
    with pytest.raises(ConfigError, match="workers must be a whole number from 1"):
        fleet.scaler.check(0)
    fleet.scaler.check(3)
    fleet.exit("worker:0", 0)
    with pytest.raises(ConfigError, match="the job is ending"):
        fleet.scaler.check(3)


def test_the_supervisor_replaces_only_a_record_that_has_ended():
    records = [TaskRecord(TaskSpec("worker", i), f"h:{i}", "worker") for i in range(2)]
    supervisor = Supervisor(records, RestartPolicy())
    supervisor.started("worker:1", 7)
    with pytest.raises(ValueError, match="still starting"):
        supervisor.add(TaskRecord(TaskSpec("worker", 1), "h:9", "worker"))
    supervisor.add(TaskRecord(TaskSpec("worker", 2), "h:2", "worker"))
    assert [r.name for r in supervisor.records] == ["worker:0", "worker:1", "worker:2"]
    assert records == supervisor.records[:2]  # the caller's list is not the supervisor's
