"""The one launcher loop (``backends/launcher.py``) over a fake task starter and a fake clock: no process starts.

The starter plays each task's incarnations (how long it runs on the fake clock, the lines it prints, its exit
code); the clock moves only when the loop sleeps. The tests check what the loop does with that: restarts after
the backoff, a job that fails for good, a task still being placed or never placed, a task that moved, the stop of
what still runs, and what reaches events.jsonl, the console and the summary.
"""

from __future__ import annotations

import io
import json
import signal
import threading
from pathlib import Path

import pytest

from tensorfleet.backends.api import StillPlacing, TaskStarter, Unplaced
from tensorfleet.backends.launcher import PS_EXIT_GRACE_S, Launcher
from tensorfleet.cluster.ports import free_ports
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch.config import JobConfig
from tensorfleet.launch.supervisor import TaskRecord


class FakeClock:
    """Seconds that pass only when the loop sleeps; each step lets the fake processes end on time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.processes: list[FakeProcess] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for process in self.processes:
            process.tick(self.now)


class FakeProcess:
    """One incarnation: prints ``lines`` at once, exits with ``code`` after ``runs_s`` (None: until signalled)."""

    _pids = iter(range(50000, 60000))

    def __init__(self, clock: FakeClock, lines: list[str], runs_s: float | None, code: int) -> None:
        self.pid = next(self._pids)
        self.stdout = self
        self.signals: list[tuple[int, bool]] = []
        self._ends_at = None if runs_s is None else clock.now + runs_s
        self._code = code
        self._lines = list(lines)
        self._exited: int | None = None
        self._changed = threading.Condition()
        clock.processes.append(self)

    def tick(self, now: float) -> None:
        if self._ends_at is not None and now >= self._ends_at:
            self._exit(self._code)

    def _exit(self, code: int) -> None:
        with self._changed:
            if self._exited is None:
                self._exited = code
            self._changed.notify_all()

    def readline(self) -> bytes:
        with self._changed:
            while not self._lines and self._exited is None:
                self._changed.wait(0.05)
            return (self._lines.pop(0) + "\n").encode() if self._lines else b""

    def poll(self) -> int | None:
        with self._changed:
            return self._exited if not self._lines else None

    def wait(self, timeout: float | None = None) -> int | None:
        return self._exited

    def signal(self, sig: int, group: bool = True) -> bool:
        if self._exited is not None:
            return False
        self.signals.append((sig, group))
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self._exit(-sig)
        return True


class FakeStarter(TaskStarter):
    """Starts fake processes from a script per task: one (runs_s, code) per incarnation; the last one repeats."""

    def __init__(self, clock: FakeClock, script: dict[str, list[tuple[float | None, int]]]) -> None:
        self.clock = clock
        self.script = script
        self.started: list[tuple[str, float, dict[str, str]]] = []  # (task, clock, its environment)
        self.processes: dict[str, list[FakeProcess]] = {}
        self.refusals: dict[tuple[str, int], list[Exception]] = {}  # (task, incarnation) -> what its starts raise
        self.moves: dict[tuple[str, int], str] = {}  # (task, incarnation) -> the address it moves to as it starts
        self.released = 0
        self.opened: Path | None = None

    def place(self, num_ps: int, num_workers: int, first_port: int | None) -> ClusterSpec:
        ports = free_ports(num_ps + num_workers)  # nothing listens: the monitor hears no task answer
        return ClusterSpec.from_dict({"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                                      "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]})

    def open(self, logdir: Path) -> None:
        self.opened = logdir

    def start(self, record: TaskRecord, command: list[str]) -> FakeProcess:
        refusals = self.refusals.get((record.name, record.restarts))
        if refusals:
            raise refusals.pop(0)
        if (record.name, record.restarts) in self.moves:
            self.host.task_moved(record.name, self.moves.pop((record.name, record.restarts)))
        env = self.host.task_env(record.task)
        self.started.append((record.name, self.clock.now, env))
        incarnations = self.script[record.name]
        runs_s, code = incarnations[min(record.restarts, len(incarnations) - 1)]
        process = FakeProcess(self.clock, [f"hello from {record.name}"], runs_s, code)
        self.processes.setdefault(record.name, []).append(process)
        return process

    def release(self) -> None:
        self.released += 1


def run_job(tmp_path: Path, script: dict[str, list[tuple[float | None, int]]], *, setup=None, **fields):
    clock = FakeClock()
    starter = FakeStarter(clock, script)
    if setup is not None:
        setup(starter)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "train.py").write_text("")
    config = JobConfig(script=str(tmp_path / "train.py"), ps=1, workers=2, logdir=str(tmp_path / "logs"),
                       restart_backoff=2.0, **fields).validate()
    out = io.StringIO()
    launcher = Launcher(config, starter, out=out, interactive=False, clock=clock, sleep=clock.sleep)
    code = launcher.run()
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    return code, launcher, starter, out.getvalue(), events


def starts_of(starter: FakeStarter, name: str) -> list[float]:
    return [when for task, when, _ in starter.started if task == name]


def test_a_crash_is_restarted_after_its_backoff_and_the_job_succeeds(tmp_path):
    script = {"ps:0": [(6.0, 0)], "worker:0": [(3.0, 0)], "worker:1": [(1.0, 1), (2.0, 0)]}
    code, launcher, starter, out, events = run_job(tmp_path, script)
    assert code == 0, out
    first, again = starts_of(starter, "worker:1")
    assert again - first == pytest.approx(1.0 + 2.0, abs=0.25)  # ran 1 s, then the 2 s backoff
    assert starts_of(starter, "ps:0") == [1000.0] and len(starts_of(starter, "worker:0")) == 1
    exits = [e for e in events if e["event"] == "exited" and e["task"] == "worker:1"]
    assert exits[0]["code"] == 1 and exits[0]["restart"] == 1 and exits[0]["delay_s"] == 2.0
    assert "[worker:1] hello from worker:1" in out
    assert "job train succeeded" in out and "1 restart," in out
    assert starter.opened == tmp_path / "logs" and starter.released == 1
    assert (tmp_path / "logs" / "worker-1.log").read_text().count("hello from worker:1") == 2


def test_a_task_that_fails_for_good_stops_the_job_and_every_other_task(tmp_path):
    script = {"ps:0": [(None, 0)], "worker:0": [(None, 0)], "worker:1": [(0.5, 7)]}
    code, launcher, starter, out, events = run_job(tmp_path, script, restart="never")
    assert code == 1
    assert [r.name for r in launcher.failed] == ["worker:1"]
    failed = [e for e in events if e["event"] == "failed"]
    assert failed[0]["task"] == "worker:1" and failed[0]["reason"] == "the restart policy is 'never'"
    for name in ("ps:0", "worker:0"):  # the others could only wait for it: stopped, by their process group
        assert starter.processes[name][0].signals == [(signal.SIGTERM, True)]
    assert "worker:1 failed: exit code 7; not restarted because the restart policy is 'never'" in out
    assert starter.released == 1


def test_the_ps_are_stopped_after_the_grace_once_every_worker_is_done(tmp_path):
    script = {"ps:0": [(None, 0)], "worker:0": [(1.0, 0)], "worker:1": [(1.0, 0)]}
    code, launcher, starter, out, events = run_job(tmp_path, script)
    assert code == 0
    ps = starter.processes["ps:0"][0]
    assert ps.signals == [(signal.SIGTERM, True)]
    stopped = [e for e in events if e["task"] == "ps:0" and e["event"] == "stopped"]
    assert stopped and stopped[0]["t"] == pytest.approx(1.0 + PS_EXIT_GRACE_S, abs=0.5)


def test_a_task_still_being_placed_is_asked_again_and_one_never_placed_fails_the_job(tmp_path):
    script = {"ps:0": [(8.0, 0)], "worker:0": [(6.0, 0)], "worker:1": [(1.0, 1), (1.0, 0)]}
    code, launcher, starter, out, events = run_job(
        tmp_path, script, setup=lambda s: s.refusals.update({("worker:1", 1): [StillPlacing(1.5)]}))
    assert code == 0, out
    first, again = starts_of(starter, "worker:1")
    assert again - first == pytest.approx(1.0 + 2.0 + 1.5, abs=0.25)  # ran, its backoff, then being placed

    script = {"ps:0": [(None, 0)], "worker:0": [(None, 0)], "worker:1": [(1.0, 1)]}
    why = "no node of the Ray cluster took it within 300 s"
    code, launcher, starter, out, events = run_job(
        tmp_path / "unplaced", script, setup=lambda s: s.refusals.update({("worker:1", 1): [Unplaced(why)]}))
    assert code == 1 and [r.name for r in launcher.failed] == ["worker:1"]
    failed = [e for e in events if e["event"] == "failed"]
    assert failed[-1]["task"] == "worker:1" and failed[-1]["reason"] == why
    assert len(starts_of(starter, "worker:1")) == 1


def test_a_task_that_moved_starts_with_the_cluster_that_names_its_new_address(tmp_path):
    script = {"ps:0": [(1.0, 1), (6.0, 0)], "worker:0": [(4.0, 0)], "worker:1": [(4.0, 0)]}
    moved_to = "127.0.0.1:1"
    code, launcher, starter, out, events = run_job(
        tmp_path, script, setup=lambda s: s.moves.update({("ps:0", 1): moved_to}))
    assert code == 0, out
    ps_addresses = [json.loads(env["TF_CONFIG"])["cluster"]["ps"] for task, _, env in starter.started
                    if task == "ps:0"]
    assert ps_addresses[0] != [moved_to] and ps_addresses[1] == [moved_to]
    assert launcher.cluster.task_address("ps", 0) == moved_to
    assert launcher.supervisor.by_name["ps:0"].address == moved_to
