"""The launcher's side of scaling, without processes: what scale_workers refuses, and the order of its steps.

Processes, signals and the ps's Resize are stood in for: the test plays the tasks (they start, answer, exit)
and the ps (it takes a Resize, or does not), and checks what the launcher does on each tick.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.launch import local as local_module
from tensorfleet.launch.config import JobConfig
from tensorfleet.launch.local import LocalLauncher
from tensorfleet.launch.supervisor import Decision, RestartPolicy, Supervisor, TaskRecord
from tensorfleet.cluster.spec import TaskSpec

PORT = 23000  # consecutive ports: nothing is bound to find free ones


def make_launcher(**fields) -> LocalLauncher:
    config = JobConfig(script="job.py", ps=1, workers=2, port=PORT, **fields)
    return LocalLauncher(config, out=io.StringIO(), interactive=False)


@pytest.mark.parametrize("mode", ["sync", None])
def test_only_an_async_job_can_be_scaled(mode):
    launcher = make_launcher(mode=mode)
    with pytest.raises(ConfigError, match=r"needs an asynchronous job \(--async\).*fixed number"):
        launcher.scale_workers(3)
    assert launcher.target_workers == 2 and launcher.supervisor.events == []
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


class Fleet:
    """Stands in for the processes and the ps: records what the launcher starts, signals and tells."""

    def __init__(self, launcher: LocalLauncher, monkeypatch) -> None:
        self.launcher = launcher
        self.started: list[str] = []
        self.asked_to_leave: list[str] = []
        self.resized: list[int] = []
        self.ps_takes_resize = True
        self._pids = iter(range(1000, 2000))
        ports = iter(range(PORT + 100, PORT + 200))
        monkeypatch.setattr(local_module, "free_ports", lambda count, host="127.0.0.1": [next(ports)
                                                                                         for _ in range(count)])
        monkeypatch.setattr(launcher, "_spawn", self._spawn)
        monkeypatch.setattr(launcher, "_send_leave", lambda process: self.asked_to_leave.append(process.name))
        monkeypatch.setattr(launcher, "_resize", self._resize)

    def _spawn(self, record: TaskRecord) -> None:
        if record.role == "ps":
            self.launcher._ps_knows[record.name] = self.launcher.cluster.num_tasks("worker")
        pid = next(self._pids)
        self.launcher.processes[record.name] = SimpleNamespace(pid=pid, name=record.name, poll=lambda: None)
        self.launcher.supervisor.started(record.name, pid)
        self.started.append(record.name)

    def _resize(self, record: TaskRecord, size: int) -> bool:
        self.resized.append(size)
        if self.ps_takes_resize:
            self.launcher._ps_knows[record.name] = size
        return self.ps_takes_resize

    def start(self) -> None:
        for record in self.launcher.supervisor.records:
            self._spawn(record)
            self.launcher.supervisor.answered(record.name, since=record.last_started)
        self.started.clear()

    def exit(self, name: str, code: int) -> Decision:
        del self.launcher.processes[name]
        return self.launcher.supervisor.exited(name, code)

    def tick(self) -> None:
        self.launcher._resize_after = 0.0  # no waiting between tries here
        self.launcher._rescale()


@pytest.fixture
def fleet(monkeypatch):
    launcher = make_launcher(mode="async")
    fleet = Fleet(launcher, monkeypatch)
    fleet.start()
    yield fleet
    launcher.monitor.stop()


def workers(launcher: LocalLauncher) -> list[str]:
    return launcher.cluster.as_dict()["worker"]


def test_scale_up_tells_every_ps_before_the_new_worker_starts(fleet):
    launcher = fleet.launcher
    fleet.ps_takes_resize = False  # ps:0 is busy: nothing may start yet
    launcher.scale_workers(3)
    assert fleet.resized == [3] and fleet.started == []
    assert len(workers(launcher)) == 3  # a ps restarting now would start with the new count
    assert [t.short for t in launcher.tasks] == ["ps:0", "worker:0", "worker:1"]  # not a task before it starts
    fleet.ps_takes_resize = True
    fleet.tick()
    assert fleet.resized == [3, 3] and fleet.started == ["worker:2"]
    assert workers(launcher)[2] == f"127.0.0.1:{PORT + 100}"  # a new free port
    assert [t.short for t in launcher.tasks] == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert [t.short for t in launcher.monitor.tasks] == ["ps:0", "worker:0", "worker:1", "worker:2"]
    assert launcher.supervisor.events[-2]["event"] == "scaled" and launcher.supervisor.events[-2]["task"] is None
    assert (launcher.supervisor.events[-2]["from"], launcher.supervisor.events[-2]["to"]) == (2, 3)


def test_scale_down_asks_the_highest_workers_to_leave_and_shrinks_once_they_are_gone(fleet):
    launcher = fleet.launcher
    launcher.scale_workers(3)
    launcher.supervisor.answered("worker:2", since=launcher.supervisor.by_name["worker:2"].last_started)
    launcher.scale_workers(1)
    assert fleet.asked_to_leave == ["worker:2", "worker:1"]  # never worker:0, the chief
    assert not launcher.supervisor.workers_done()
    assert fleet.exit("worker:2", 0) is Decision.DONE
    fleet.tick()
    assert len(workers(launcher)) == 3 and fleet.resized == [3]  # worker:1 is still saying Done
    # One that dies of the signal (a loop without TrainingSession) is stopped, not restarted nor failed.
    assert fleet.exit("worker:1", -10) is Decision.STOPPED
    assert launcher.supervisor.by_name["worker:1"].state == "stopped" and launcher.supervisor.failed() == []
    fleet.tick()
    assert len(workers(launcher)) == 1 and fleet.resized == [3, 1]
    assert [t.short for t in launcher.monitor.tasks] == ["ps:0", "worker:0"]
    assert launcher.supervisor.by_name["worker:2"].state == "done"  # kept for the summary
    assert not launcher.supervisor.workers_done()  # worker:0 still trains
    fleet.exit("worker:0", 0)
    assert launcher.supervisor.workers_done()


def test_a_scale_up_after_a_scale_down_waits_until_every_ps_knows_the_shrink(fleet):
    """Otherwise a ps told 3 -> 2 instead of 3 -> 1 -> 2 would count the returning worker:1's old Done."""
    launcher = fleet.launcher
    launcher.scale_workers(3)
    launcher.scale_workers(1)
    launcher.scale_workers(2)  # before the leavers are even gone: the newest count wins
    assert fleet.asked_to_leave == ["worker:2", "worker:1"]
    fleet.exit("worker:2", 0)
    fleet.exit("worker:1", 0)
    fleet.ps_takes_resize = False
    fleet.tick()
    assert fleet.resized == [3, 1] and len(workers(launcher)) == 1 and fleet.started == ["worker:2"]
    fleet.ps_takes_resize = True
    fleet.tick()
    assert fleet.resized == [3, 1, 1, 2] and fleet.started == ["worker:2", "worker:1"]
    record = launcher.supervisor.by_name["worker:1"]
    assert (record.state, record.leaving, record.restarts) == ("starting", False, 0)  # a new worker
    assert launcher.supervisor.records.count(record) == 1 and len(launcher.supervisor.records) == 4
    assert workers(launcher)[1] != f"127.0.0.1:{PORT + 2}"  # a new port, not the one it left


def test_a_worker_waiting_for_its_restart_leaves_at_once(fleet):
    launcher = fleet.launcher
    assert fleet.exit("worker:1", 1) is Decision.RESTART
    launcher.scale_workers(1)
    assert fleet.asked_to_leave == []
    assert launcher.supervisor.by_name["worker:1"].state == "stopped"
    assert launcher.supervisor.due() == []
    fleet.tick()
    assert len(workers(launcher)) == 1 and fleet.resized == [1]


def test_a_finished_chief_ends_scaling(fleet):
    fleet.exit("worker:0", 0)
    with pytest.raises(ConfigError, match="the job is ending"):
        fleet.launcher.scale_workers(3)


def test_the_supervisor_replaces_only_a_record_that_has_ended():
    records = [TaskRecord(TaskSpec("worker", i), f"h:{i}", "worker") for i in range(2)]
    supervisor = Supervisor(records, RestartPolicy())
    supervisor.started("worker:1", 7)
    with pytest.raises(ValueError, match="still starting"):
        supervisor.add(TaskRecord(TaskSpec("worker", 1), "h:9", "worker"))
    supervisor.add(TaskRecord(TaskSpec("worker", 2), "h:2", "worker"))
    assert [r.name for r in supervisor.records] == ["worker:0", "worker:1", "worker:2"]
    assert records == supervisor.records[:2]  # the caller's list is not the supervisor's
