"""FleetMonitor's picture from Status answers fed by hand on a fake clock: rates, ETA, and a job's end."""

from __future__ import annotations

import json

import pytest

from tensorfleet.cluster import environment
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.dashboard.picture import FleetPicture, TablePart, TaskPicture
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


def answer(monitor: FleetMonitor, clock: Clock, at: float, answers: dict[str, dict]) -> FleetPicture:
    clock.now = at
    monitor.update(answers, asked=at)
    return monitor.picture()


def states(picture: FleetPicture) -> dict[str, str | None]:
    return {task.name: task.state for task in picture.tasks}


def task(picture: FleetPicture, name: str) -> TaskPicture:
    return next(t for t in picture.tasks if t.name == name)


def test_no_rate_nor_eta_until_two_seconds_of_training(monitor, clock):
    for t in range(4):  # start-up: every task answers, the global step is still 0
        answer(monitor, clock, t, {"ps:0": ps(0), "worker:0": worker(0), "worker:1": worker(0)})
    # then 100 steps/s
    picture = answer(monitor, clock, 4, {"ps:0": ps(10), "worker:0": worker(10), "worker:1": worker(10)})
    picture = answer(monitor, clock, 5, {"ps:0": ps(110), "worker:0": worker(110), "worker:1": worker(110)})
    job = picture.job
    assert (job.eta_s, job.steps_per_sec, job.examples_per_sec) == (None, None, None)
    line = progress_line(picture)
    assert line.startswith("step 110/2,000 (6%) | ") and "ETA" not in line and "/s" not in line, line

    picture = answer(monitor, clock, 6, {"ps:0": ps(210), "worker:0": worker(210), "worker:1": worker(210)})
    job = picture.job
    assert job.steps_per_sec == pytest.approx(100.0)
    assert job.examples_per_sec == pytest.approx(2 * 16 * 100.0)
    assert job.eta_s == pytest.approx((TARGET - 210) / 100.0)
    assert "100 steps/s | ETA 18s" in progress_line(picture)


def test_an_attached_monitor_sees_the_job_end(monitor, clock):
    answer(monitor, clock, 0, {"ps:0": ps(50), "worker:0": worker(50), "worker:1": worker(50, loss=9.0)})
    # worker:1 finished and no longer answers; the ps heard its Done. The loss is worker:0's alone.
    picture = answer(monitor, clock, 10, {"ps:0": ps(900, done=(1,)), "worker:0": worker(900, loss=0.25)})
    assert states(picture) == {"ps:0": "running", "worker:0": "running", "worker:1": "done"}
    assert picture.job.state == "running" and picture.history[-1].loss == 0.25

    # The last worker's final answer said done; then only the lingering ps answers, done too.
    answer(monitor, clock, 11, {"ps:0": ps(1000, done=(1,)), "worker:0": worker(1000, state="done")})
    picture = answer(monitor, clock, 12, {"ps:0": ps(1000, done=(0, 1))})
    assert states(picture) == {"ps:0": "done", "worker:0": "done", "worker:1": "done"}
    job = picture.job
    assert job.state == "succeeded" and job.global_step == 1000
    assert (job.eta_s, job.steps_per_sec, job.examples_per_sec) == (None, None, None)

    # Finished: nothing answers any more, and nothing changes: no new chart points, no ticking clock.
    points, elapsed = len(picture.history), job.elapsed_s
    later = answer(monitor, clock, 30, {})
    assert len(later.history) == points and later.job.elapsed_s == elapsed
    assert later.job.state == "succeeded" and set(states(later).values()) == {"done"}


def test_a_task_that_stops_without_saying_done_is_unreachable_and_the_job_not_done(monitor, clock):
    answer(monitor, clock, 0, {"ps:0": ps(50), "worker:0": worker(50), "worker:1": worker(50)})
    answer(monitor, clock, 1, {"ps:0": ps(60), "worker:0": worker(60, state="done"), "worker:1": worker(60)})
    picture = answer(monitor, clock, 10, {"ps:0": ps(60, done=(0,))})  # worker:1 vanished mid-training
    assert states(picture) == {"ps:0": "running", "worker:0": "done", "worker:1": "unreachable"}
    assert picture.job.state == "running"
    # Then the ps goes too, without having said done: still not a finished job.
    picture = answer(monitor, clock, 20, {})
    assert states(picture)["ps:0"] == "unreachable" and picture.job.state == "running"


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


def rows_per_sec(picture: FleetPicture) -> dict[tuple[str, str], float | None]:
    return {(t.name, table): fields.rows_per_sec for t in picture.tasks if t.tables
            for table, fields in t.tables.items()}


def test_embedding_tables_rows_per_shard_rate_and_unique_ids(sharded, clock):
    # ps:0 creates 100 users and 10 items a second, ps:1 50 users and 20 items
    def created(t: int) -> dict[str, tuple[int, int]]:
        return {"ps:0": (100 * t, 10 * t), "ps:1": (50 * t, 20 * t)}

    picture = answer(sharded, clock, 1, tables_round(10, created(1)))
    shown = {table: {k: getattr(fields, k) for k in ("rows", "bytes", "rows_per_sec")}
             for table, fields in task(picture, "ps:1").tables.items()}
    assert shown == {"users": {"rows": 1050, "bytes": 64 * 1050, "rows_per_sec": None},
                     "items": {"rows": 520, "bytes": 64 * 520, "rows_per_sec": None}}
    assert picture.job.table_rows == 1100 + 510 + 1050 + 520
    assert picture.job.rows_per_sec is None  # one poll: no rate yet
    assert [task(picture, name).unique_ids for name in ("ps:0", "worker:0", "worker:1")] == [None, 300, 280]
    assert task(picture, "worker:0").tables is None

    for t in range(2, 9):
        picture = answer(sharded, clock, t, tables_round(10 * t, created(t)))
    assert rows_per_sec(picture) == pytest.approx(
        {("ps:0", "users"): 100, ("ps:0", "items"): 10, ("ps:1", "users"): 50, ("ps:1", "items"): 20})
    assert picture.job.rows_per_sec == pytest.approx(180)
    assert picture.job.table_rows == 2 * (1000 + 500) + (100 + 10 + 50 + 20) * 8
    assert "4,440 table rows (+180/s)" in progress_line(picture)
    assert picture.to_json()["history"][-1].keys() == {"t", "global_step", "loss", "examples_per_sec", "steps_per_sec"}


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
    assert picture.job.rows_per_sec == pytest.approx(100 + 10 + 40)
    assert task(picture, "ps:1").tables["users"].rows == 1080


def test_a_job_without_tables_has_none_of_their_figures(monitor, clock):
    for t in range(1, 5):
        step = 10 * t
        picture = answer(monitor, clock, t, {"ps:0": ps(step), "worker:0": worker(step), "worker:1": worker(step)})
    assert picture.job.steps_per_sec == pytest.approx(10)
    assert (picture.job.table_rows, picture.job.rows_per_sec) == (None, None)
    assert all(t.tables is None and t.unique_ids is None for t in picture.tasks)
    assert "table rows" not in progress_line(picture)
    # a ps of an older version, which says nothing about tables, reads the same
    picture = answer(monitor, clock, 5, {"ps:0": {"role": "ps", "global_step": 50}})
    assert task(picture, "ps:0").tables is None and picture.job.table_rows is None


# --- junk in Status answers (issue 18, item 7): a task's answer is data from the network --------------------

JUNK = ["abc", [1], {"a": 1}, float("nan"), float("inf"), 10 ** 400, True]
# the counts of a ps's and of a worker's Status that the picture shows
PS_COUNTS = ["global_step", "applied_updates", "dropped_stale", "pid"]
WORKER_COUNTS = ["global_step", "local_step", "examples", "target_step", "unique_ids", "pid"]


def junk_answer(junk) -> dict:
    """A Status answer with ``junk`` in every field the picture shows of a ps or a worker, and in role (which
    the cluster says, not the answer)."""
    answer = {field: junk for field in [*PS_COUNTS, *WORKER_COUNTS, "loss", "state", "mode", "done_replicas",
                                        "tables", "role"]}
    answer["done_replicas"] = [junk] if isinstance(junk, list) else junk  # [1] would be a good list
    return answer


@pytest.mark.parametrize("junk", JUNK, ids=["str", "list", "dict", "nan", "inf", "huge", "bool"])
def test_junk_in_every_status_field_is_shown_as_none_and_never_raises(monitor, clock, junk, caplog):
    from tensorfleet.dashboard.metrics import render_metrics

    answers = {name: junk_answer(junk) for name in ("ps:0", "worker:0", "worker:1")}
    with caplog.at_level("WARNING", logger=monitor_module.__name__):
        for t in range(5):
            picture = answer(monitor, clock, t, answers)
    job = picture.job
    assert job.global_step == 0 and job.target_step is None and job.dropped_stale == 0
    assert (job.eta_s, job.steps_per_sec, job.examples_per_sec) == (None, None, None)
    assert (job.mode, job.table_rows, job.rows_per_sec) == (None, None, None)
    for task in picture.tasks:
        assert task.state == "running"  # it answers: alive, whatever it said
        for key in ("pid", "step", "global_step", "loss", "unique_ids", "tables", "examples_per_sec"):
            assert getattr(task, key) is None, (task.name, key, getattr(task, key))
    assert all(point.global_step == 0 and point.loss is None for point in picture.history)
    assert progress_line(picture) == "step 0 | 3/3 tasks running"
    render_metrics(picture)  # the dashboard's /metrics
    json.dumps(picture.to_json(), allow_nan=False)  # the dashboard's /api/status

    # One warning per task and field, not one per poll: 5 polls of 3 tasks with junk in ~8 fields each.
    warned = [(r.task_name, r.field) for r in caplog.records if hasattr(r, "field")]
    assert len(warned) == len(set(warned)) and len(warned) >= 3 * 8, warned
    assert {name for name, _ in warned} == {"ps:0", "worker:0", "worker:1"}
    assert {field for name, field in warned if name == "worker:0"} >= {*WORKER_COUNTS, "loss", "role"}
    assert {field for name, field in warned if name == "ps:0"} >= {*PS_COUNTS, "mode", "done_replicas", "tables",
                                                                   "role"}


def test_junk_in_one_task_leaves_the_others_figures(monitor, clock):
    bad = {"role": "worker", "global_step": "abc", "local_step": -5, "examples": 2.5, "loss": "0.5",
           "target_step": [TARGET], "unique_ids": 10 ** 30, "pid": True, "state": {"done": True}}
    for t in range(4):
        step = 100 * (t + 1)
        picture = answer(monitor, clock, t, {"ps:0": ps(step), "worker:0": worker(step, loss=0.25), "worker:1": bad})
    job = picture.job
    assert job.global_step == 400 and job.target_step == TARGET
    assert job.steps_per_sec == pytest.approx(100) and job.examples_per_sec == pytest.approx(1600)
    assert picture.history[-1].loss == 0.25  # worker:1's "0.5" is no loss
    good, junk = task(picture, "worker:0"), task(picture, "worker:1")
    assert (good.step, good.loss, good.examples_per_sec) == (200, 0.25, pytest.approx(1600))
    assert (junk.step, junk.global_step, junk.loss, junk.pid, junk.unique_ids) == (None,) * 5
    assert junk.state == "running" and junk.examples_per_sec is None
    assert "step 400/2,000 (20%)" in progress_line(picture)


def test_junk_done_replicas_mark_no_worker_done(monitor, clock):
    # True is an int to Python: it must not stand for replica 1; nor "0", 1.0, -1 or an index past the workers.
    picture = answer(monitor, clock, 0, {"ps:0": {**ps(50), "done_replicas": [True, "0", 1.0, -1, 99, None]},
                                         "worker:0": worker(50), "worker:1": worker(50)})
    assert states(picture) == {"ps:0": "running", "worker:0": "running", "worker:1": "running"}
    picture = answer(monitor, clock, 1, {"ps:0": {**ps(60), "done_replicas": 5}, "worker:0": worker(60)})
    assert states(picture)["worker:0"] == "running"
    picture = answer(monitor, clock, 2, {"ps:0": ps(70, done=(1,)), "worker:0": worker(70)})  # a real one still counts
    assert states(picture)["worker:1"] == "done"


@pytest.mark.parametrize("tables", ["abc", [1], 7, {"users": "abc"}, {"users": [1, 2]},
                                    {"users": {"rows": "abc", "bytes": float("nan"), "rows_created": [1]}},
                                    {"users": {"rows": True, "bytes": -1, "rows_created": 10 ** 400}}])
def test_junk_tables_are_tolerated(sharded, clock, tables):
    from tensorfleet.dashboard.metrics import render_metrics

    def created(t: int) -> dict[str, tuple[int, int]]:
        return {"ps:0": (100 * t, 10 * t), "ps:1": (50 * t, 20 * t)}

    for t in range(1, 6):
        answers = tables_round(10 * t, created(t))
        answers["ps:1"]["tables"] = tables
        picture = answer(sharded, clock, t, answers)
    shown = task(picture, "ps:1").tables
    assert shown is None or shown == {"users": TablePart()}, shown  # every count None
    assert picture.job.table_rows == 1000 + 500 + 100 * 5 + 10 * 5  # ps:0's alone
    assert picture.job.rows_per_sec == pytest.approx(110)
    assert "table rows" in progress_line(picture)
    render_metrics(picture)
    json.dumps(picture.to_json(), allow_nan=False)


def test_a_final_status_that_is_not_an_object_is_an_empty_answer(monitor, clock):
    picture = answer(monitor, clock, 0, {"ps:0": ["not", "a", "dict"], "worker:0": "abc", "worker:1": None})
    assert picture.job.global_step == 0 and set(states(picture).values()) == {"running"}
    assert progress_line(picture) == "step 0 | 3/3 tasks running"


def test_each_shards_admissions_evictions_and_part_of_the_traffic_show_a_hot_shard(sharded, clock):
    answers = tables_round(10, {"ps:0": (5, 5), "ps:1": (5, 5)})
    for name, (updates, lookups, evicted) in {"ps:0": (9000, 18000, 40), "ps:1": (1000, 2000, 0)}.items():
        answers[name]["tables"]["users"].update(row_updates=updates, lookups=lookups, evicted=evicted,
                                                admitted=300, refused_updates=1200)
    picture = answer(sharded, clock, 1, answers)
    hot, cold = task(picture, "ps:0").tables["users"], task(picture, "ps:1").tables["users"]
    assert (hot.traffic_share, cold.traffic_share) == pytest.approx((0.9, 0.1))
    assert (hot.evicted, hot.admitted, hot.refused_updates) == (40, 300, 1200)
    assert task(picture, "ps:0").tables["items"].traffic_share is None  # no traffic counted anywhere


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_jobs_global_step_is_ps0s_and_each_shard_shows_its_own_counters(clock, mode):
    # Sync with backups: ps:1 aggregated 3 steps more than ps:0 (the owner) counts; async: ps:1 never counts steps.
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3"]})
    fleet = FleetMonitor(cluster, job_name="unit")
    try:
        shard1_step = 3003 if mode == "sync" else 0
        picture = answer(fleet, clock, 0, {
            "ps:0": {"role": "ps", "mode": mode, "global_step": 3000, "applied_updates": 3000},
            "ps:1": {"role": "ps", "mode": mode, "global_step": shard1_step, "applied_updates": 3003},
            "worker:0": worker(2990)})
    finally:
        fleet.stop()
    assert picture.job.global_step == 3000
    ps1 = task(picture, "ps:1")
    assert ps1.step == 3003  # the updates the shard applied: its own counter
    assert ps1.global_step == (3003 if mode == "sync" else None)  # async: not a step counter at all
    assert task(picture, "ps:0").global_step == 3000 and task(picture, "worker:0").global_step == 2990


def test_a_worker_scaled_away_while_its_status_is_asked_leaves_the_monitor_polling(monitor):
    """The launcher's thread scales the job down (``set_cluster``) while the monitor's thread waits on the leaver's
    Status, which then fails (the leaver exited). Before, the failure looked the leaver up among the current
    channels: a KeyError ended the polling thread, and the picture stayed as it was for the rest of the job (a
    scaled job's test waited for steps that never showed). Real calls: nothing listens at these addresses."""
    without_leaver = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    leaver = monitor._channels["worker:1"]
    ask = leaver.call_async

    class ScaledAwayMeanwhile:
        """The leaver's pending answer; the scale happens while the monitor waits on it."""

        def __init__(self, future) -> None:
            self.future = future

        def result(self):
            monitor.set_cluster(without_leaver)
            return self.future.result()

    leaver.call_async = lambda *args, **kwargs: ScaledAwayMeanwhile(ask(*args, **kwargs))
    monitor.poll(timeout_s=1.0)  # before: KeyError: 'worker:1'
    assert [t.short for t in monitor.tasks] == ["ps:0", "worker:0"]
    monitor.poll(timeout_s=1.0)  # the next round asks the tasks left
    assert {t.name for t in monitor.picture().tasks} == {"ps:0", "worker:0"}
