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


def ps(step: int, *, done: tuple[int, ...] = (), tables: dict[str, tuple[int, int]] | None = None) -> dict:
    """A ps's Status; ``done``: the replicas that said Done (all of them: the ps is done);
    ``tables``: table name -> (rows, rows created since the ps started)."""
    return {"role": "ps", "global_step": step, "state": "done" if len(done) == 2 else "running",
            "done_replicas": list(done),
            "tables": {name: {"rows": rows, "rows_created": created, "bytes": 64 * rows, "bytes_per_row_bare": 48.0,
                              "bytes_per_row_held": 64.0, "bytes_per_row_map": 16.0}
                       for name, (rows, created) in (tables or {}).items()}}


def worker(step: int, *, loss: float = 0.5, state: str = "training", unique_ids: int | None = None) -> dict:
    return {"role": "worker", "state": state, "global_step": step, "local_step": step // 2, "examples": 16 * step,
            "loss": loss, "target_step": TARGET, "unique_ids": unique_ids}


def answer(monitor: FleetMonitor, clock: Clock, at: float, answers: dict[str, dict]) -> dict:
    clock.now = at
    monitor.update(answers, asked=at)
    return monitor.picture()


def states(picture: dict) -> dict[str, str]:
    return {task["name"]: task["state"] for task in picture["tasks"]}


def task(picture: dict, name: str) -> dict:
    return next(t for t in picture["tasks"] if t["name"] == name)


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


@pytest.fixture
def sharded(clock):
    """Two ps shards, each holding its part of the tables "users" and "items"; two workers."""
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3", "127.0.0.1:4"]})
    fleet = FleetMonitor(cluster, job_name="unit")
    yield fleet
    fleet.stop()


def tables_round(step: int, created: dict[str, tuple[int, int]], *, unique_ids: tuple[int, int] = (300, 280)) -> dict:
    """Every task's answer at ``step``; ``created``: per shard, rows created in "users" and in "items".
    Rows held are created ones plus what each shard restored (1000 users and 500 items each)."""
    answers = {f"ps:{i}": ps(step, tables={"users": (1000 + users, users), "items": (500 + items, items)})
               for i, (users, items) in enumerate([created["ps:0"], created["ps:1"]])}
    answers.update({f"worker:{i}": worker(step, unique_ids=unique_ids[i]) for i in range(2)})
    return answers


def rows_per_sec(picture: dict) -> dict[tuple[str, str], float | None]:
    return {(t["name"], table): fields["rows_per_sec"] for t in picture["tasks"] if t["tables"]
            for table, fields in t["tables"].items()}


def test_embedding_tables_rows_per_shard_rate_and_unique_ids(sharded, clock):
    # ps:0 creates 100 users and 10 items a second, ps:1 50 users and 20 items
    def created(t: int) -> dict[str, tuple[int, int]]:
        return {"ps:0": (100 * t, 10 * t), "ps:1": (50 * t, 20 * t)}

    picture = answer(sharded, clock, 1, tables_round(10, created(1)))
    assert task(picture, "ps:1")["tables"] == {"users": {"rows": 1050, "bytes": 64 * 1050, "rows_per_sec": None},
                                               "items": {"rows": 520, "bytes": 64 * 520, "rows_per_sec": None}}
    assert picture["job"]["table_rows"] == 1100 + 510 + 1050 + 520
    assert picture["job"]["rows_per_sec"] is None  # one poll: no rate yet
    assert [task(picture, name)["unique_ids"] for name in ("ps:0", "worker:0", "worker:1")] == [None, 300, 280]
    assert task(picture, "worker:0")["tables"] is None

    for t in range(2, 9):
        picture = answer(sharded, clock, t, tables_round(10 * t, created(t)))
    assert rows_per_sec(picture) == pytest.approx(
        {("ps:0", "users"): 100, ("ps:0", "items"): 10, ("ps:1", "users"): 50, ("ps:1", "items"): 20})
    assert picture["job"]["rows_per_sec"] == pytest.approx(180)
    assert picture["job"]["table_rows"] == 2 * (1000 + 500) + (100 + 10 + 50 + 20) * 8
    assert "4,440 table rows (+180/s)" in progress_line(picture)
    assert picture["history"][-1].keys() == {"t", "global_step", "loss", "examples_per_sec", "steps_per_sec"}


def test_a_restarted_ps_restarts_its_rows_rate(sharded, clock):
    def created(t: int, *, restarted_at: int | None = None) -> dict[str, tuple[int, int]]:
        ps1 = 10 * t if restarted_at is None else 40 * (t - restarted_at)  # from 0 after its restart
        return {"ps:0": (100 * t, 10 * t), "ps:1": (ps1, 0)}

    for t in range(1, 8):
        picture = answer(sharded, clock, t, tables_round(10 * t, created(t)))
    assert rows_per_sec(picture)[("ps:1", "users")] == pytest.approx(10)

    # ps:1 restarts from a checkpoint: its counter starts over at 0, and the rate with it
    for t in (8, 9):
        picture = answer(sharded, clock, t, tables_round(10 * t, created(t, restarted_at=8)))
        assert rows_per_sec(picture)[("ps:1", "users")] is None  # less than two seconds since the restart
        assert rows_per_sec(picture)[("ps:0", "users")] == pytest.approx(100)  # the other shard goes on
    # 2 s after the restart: the new rate alone, though older samples are still in the window, and though
    # the new count (80) is already above the one the window starts at (50, at 5 s): no mix of the two lives
    picture = answer(sharded, clock, 10, tables_round(100, created(10, restarted_at=8)))
    assert rows_per_sec(picture)[("ps:1", "users")] == pytest.approx(40)
    assert rows_per_sec(picture)[("ps:1", "items")] == pytest.approx(0)
    assert picture["job"]["rows_per_sec"] == pytest.approx(100 + 10 + 40)
    assert task(picture, "ps:1")["tables"]["users"]["rows"] == 1080


def test_a_job_without_tables_has_none_of_their_figures(monitor, clock):
    for t in range(1, 5):
        step = 10 * t
        picture = answer(monitor, clock, t, {"ps:0": ps(step), "worker:0": worker(step), "worker:1": worker(step)})
    assert picture["job"]["steps_per_sec"] == pytest.approx(10)
    assert (picture["job"]["table_rows"], picture["job"]["rows_per_sec"]) == (None, None)
    assert all(t["tables"] is None and t["unique_ids"] is None for t in picture["tasks"])
    assert "table rows" not in progress_line(picture)
    # a ps of an older version, which says nothing about tables, reads the same
    picture = answer(monitor, clock, 5, {"ps:0": {"role": "ps", "global_step": 50}})
    assert task(picture, "ps:0")["tables"] is None and picture["job"]["table_rows"] is None
