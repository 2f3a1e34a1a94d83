"""FleetMonitor's picture from Status answers fed by hand on a fake clock: rates, ETA, and a job's end."""

from __future__ import annotations

import pytest

from tensorfleet.cluster import environment
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch import monitor as monitor_module
from tensorfleet.launch.monitor import FleetMonitor, progress_line

TARGET = 2000


class Clock:
    """Stands in for the monitor's ``time`` module: ``monotonic()`` is whatever the test set."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(monitor_module, "time", clock)
    return clock


@pytest.fixture
def monitor(clock):
    # Nothing listens at these addresses, and nothing asks them: the test feeds the answers.
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    fleet = FleetMonitor(cluster, job_name="unit")
    yield fleet
    fleet.stop()


def ps(step: int, *, done: tuple[int, ...] = ()) -> dict:
    """A ps's Status; ``done``: the replicas that said Done (all of them: the ps is done)."""
    return {"role": "ps", "global_step": step, "state": "done" if len(done) == 2 else "running",
            "done_replicas": list(done)}


def worker(step: int, *, loss: float = 0.5, state: str = "training") -> dict:
    return {"role": "worker", "state": state, "global_step": step, "local_step": step // 2, "examples": 16 * step,
            "loss": loss, "target_step": TARGET}


def answer(monitor: FleetMonitor, clock: Clock, at: float, answers: dict[str, dict]) -> dict:
    clock.now = at
    monitor.update(answers, asked=at)
    return monitor.picture()


def states(picture: dict) -> dict[str, str]:
    return {task["name"]: task["state"] for task in picture["tasks"]}


def test_no_rate_nor_eta_until_two_seconds_of_training(monitor, clock):
    for t in range(4):  # start-up: every task answers, the global step is still 0
        answer(monitor, clock, t, {"ps:0": ps(0), "worker:0": worker(0), "worker:1": worker(0)})
    # then 100 steps/s
    picture = answer(monitor, clock, 4, {"ps:0": ps(10), "worker:0": worker(10), "worker:1": worker(10)})
    picture = answer(monitor, clock, 5, {"ps:0": ps(110), "worker:0": worker(110), "worker:1": worker(110)})
    job = picture["job"]
    assert (job["eta_s"], job["steps_per_sec"], job["examples_per_sec"]) == (None, None, None)
    line = progress_line(picture)
    assert line.startswith("step 110/2,000 (6%) | ") and "ETA" not in line and "/s" not in line, line

    picture = answer(monitor, clock, 6, {"ps:0": ps(210), "worker:0": worker(210), "worker:1": worker(210)})
    job = picture["job"]
    assert job["steps_per_sec"] == pytest.approx(100.0)
    assert job["examples_per_sec"] == pytest.approx(2 * 16 * 100.0)
    assert job["eta_s"] == pytest.approx((TARGET - 210) / 100.0)
    assert "100 steps/s | ETA 18s" in progress_line(picture)


def test_an_attached_monitor_sees_the_job_end(monitor, clock):
    answer(monitor, clock, 0, {"ps:0": ps(50), "worker:0": worker(50), "worker:1": worker(50, loss=9.0)})
    # worker:1 finished and no longer answers; the ps heard its Done. The loss is worker:0's alone.
    picture = answer(monitor, clock, 10, {"ps:0": ps(900, done=(1,)), "worker:0": worker(900, loss=0.25)})
    assert states(picture) == {"ps:0": "running", "worker:0": "running", "worker:1": "done"}
    assert picture["job"]["state"] == "running" and picture["history"][-1]["loss"] == 0.25

    # The last worker's final answer said done; then only the lingering ps answers, done too.
    answer(monitor, clock, 11, {"ps:0": ps(1000, done=(1,)), "worker:0": worker(1000, state="done")})
    picture = answer(monitor, clock, 12, {"ps:0": ps(1000, done=(0, 1))})
    assert states(picture) == {"ps:0": "done", "worker:0": "done", "worker:1": "done"}
    job = picture["job"]
    assert job["state"] == "succeeded" and job["global_step"] == 1000
    assert (job["eta_s"], job["steps_per_sec"], job["examples_per_sec"]) == (None, None, None)

    # Finished: nothing answers any more, and nothing changes: no new chart points, no ticking clock.
    points, elapsed = len(picture["history"]), job["elapsed_s"]
    later = answer(monitor, clock, 30, {})
    assert len(later["history"]) == points and later["job"]["elapsed_s"] == elapsed
    assert later["job"]["state"] == "succeeded" and set(states(later).values()) == {"done"}


def test_a_task_that_stops_without_saying_done_is_unreachable_and_the_job_not_done(monitor, clock):
    answer(monitor, clock, 0, {"ps:0": ps(50), "worker:0": worker(50), "worker:1": worker(50)})
    answer(monitor, clock, 1, {"ps:0": ps(60), "worker:0": worker(60, state="done"), "worker:1": worker(60)})
    picture = answer(monitor, clock, 10, {"ps:0": ps(60, done=(0,))})  # worker:1 vanished mid-training
    assert states(picture) == {"ps:0": "running", "worker:0": "done", "worker:1": "unreachable"}
    assert picture["job"]["state"] == "running"
    # Then the ps goes too, without having said done: still not a finished job.
    picture = answer(monitor, clock, 20, {})
    assert states(picture)["ps:0"] == "unreachable" and picture["job"]["state"] == "running"


def test_a_finished_ps_lingers_only_when_no_launcher_reads_its_final_status(monkeypatch):
    monkeypatch.delenv(environment.STATUS_DIR_ENV, raising=False)
    assert 1.0 <= environment.finished_linger_s() <= 2.0
    monkeypatch.setenv(environment.STATUS_DIR_ENV, "/tmp/logs")
    assert environment.finished_linger_s() == 0.0
