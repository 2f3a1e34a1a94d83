"""What a task answers to Status, typed (protocol/status.py): the lenient ``read`` the launcher's monitor uses
(a junk field is None and reported, the others kept) and the strict ``from_meta``."""

from __future__ import annotations

import dataclasses

import pytest

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import SyncOptions
from tensorfleet.protocol.status import MAX_COUNT, MAX_TEXT, TABLE_COUNTS, PsStatus, TableCounts, WorkerStatus
from tensorfleet.worker.status import TaskStatus

WORKER = WorkerStatus(task="/job:worker/task:0", role="chief", state="training", pid=42, uptime_s=3.5, local_step=7,
                      global_step=20, dropped_gradients=1, loss=0.25, examples=112, target_step=100, unique_ids=9,
                      last_step_age_s=0.1)
PS = PsStatus(initialized=True, mode="sync", global_step=20, applied_updates=20, dropped_stale=2, pid=41,
              uptime_s=9.0, task="/job:ps/task:0", done_replicas=[0], workers_done=1, num_workers=2,
              sync=SyncOptions(2, 2), data_port=5000, auth_refused=3,
              tables={"users": TableCounts(**{key: 10 * i for i, key in enumerate(TABLE_COUNTS)})})

COUNT = "a whole number from 0 to 9223372036854775807"
# (a field, a junk value of each kind it can have, what the report says it must be)
JUNK = [
    *[(cls, field, value, COUNT) for cls, field in [(WorkerStatus, "local_step"), (WorkerStatus, "pid"),
                                                     (PsStatus, "applied_updates"), (PsStatus, "data_port")]
      for value in ["12", True, -1, MAX_COUNT + 1, 2.5, float("nan"), float("inf"), [3], {"n": 3}]],
    *[(WorkerStatus, field, value, "a finite number") for field in ("loss", "uptime_s", "last_step_age_s")
      for value in ["0.5", True, float("nan"), float("-inf"), 10 ** 400, [0.5]]],
    *[(cls, "state", value, f"a string of at most {MAX_TEXT} characters")
      for cls in (PsStatus, WorkerStatus) for value in ["x" * (MAX_TEXT + 1), 3, True, ["done"], {"done": 1}]],
    *[(PsStatus, "mode", value, "'sync' or 'async'") for value in ["SYNC", "", 1, True, ["sync"]]],
    *[(PsStatus, "role", value, "'ps'") for value in ["worker", 1]],
    *[(WorkerStatus, "role", value, "'worker' or 'chief'") for value in ["ps", "Chief", 0]],
    *[(PsStatus, "initialized", value, "true or false") for value in [1, "true", [True]]],
    *[(PsStatus, "sync", value, "the job's sync options") for value in ["sync", [2, 2], {"replicas_to_aggregate": 3,
                                                                                         "total_num_replicas": 2}]],
    *[(PsStatus, "done_replicas", value, "a list of worker indices") for value in [0, "0", {"0": 1}]],
    *[(PsStatus, "tables", value, "an object of tables, each an object of counts") for value in ["users", [1], 7]],
]


def reader():
    """``read``'s on_junk that keeps what it was told."""
    told: list[tuple[str, object, str]] = []
    return told, lambda field, value, expected: told.append((field, value, expected))


@pytest.mark.parametrize("cls", [PsStatus, WorkerStatus])
def test_every_field_has_a_check(cls):
    assert list(cls.CHECKS) == [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("status", [PS, WORKER])
def test_a_good_status_reads_back_as_it_was_sent_and_nothing_is_reported(status):
    told, on_junk = reader()
    assert type(status).read(status.to_meta(), on_junk) == status and told == []


def test_a_workers_status_is_a_worker_status_on_the_wire():
    status = TaskStatus()
    status.report(loss=0.5, examples=16, target_step=10)
    told, on_junk = reader()
    read = WorkerStatus.read(status.as_meta(), on_junk)
    assert told == [] and (read.state, read.role, read.loss, read.examples, read.target_step) == (
        "starting", "worker", 0.5, 16, 10)
    assert read.last_step_age_s is None and read.unique_ids is None  # no step yet, no tables: not junk


@pytest.mark.parametrize("cls, field, junk, expected", JUNK, ids=lambda v: repr(v)[:20])
def test_a_junk_field_is_none_and_reported_once_and_the_others_are_kept(cls, field, junk, expected):
    good = PS if cls is PsStatus else WORKER
    told, on_junk = reader()
    read = cls.read({**good.to_meta(), field: junk}, on_junk)
    assert read == dataclasses.replace(good, **{field: None})
    assert told == [(field, junk, expected)]


def test_a_whole_float_is_a_count_and_absent_fields_are_none_without_a_word():
    told, on_junk = reader()
    read = WorkerStatus.read({"local_step": 3.0, "examples": 0.0}, on_junk)
    assert (read.local_step, read.examples) == (3, 0) and type(read.local_step) is int
    assert read == dataclasses.replace(WorkerStatus.unknown(), local_step=3, examples=0) and told == []
    assert PsStatus.read({}, on_junk) == PsStatus.unknown() and told == []


@pytest.mark.parametrize("answer", [None, "abc", [1, 2], 7])
def test_an_answer_that_is_not_an_object_says_nothing(answer):
    told, on_junk = reader()
    assert PsStatus.read(answer, on_junk) == PsStatus.unknown()
    assert told == [("status", answer, "an object")]


def test_bad_replica_ids_are_left_out_and_the_good_ones_kept():
    told, on_junk = reader()
    done = [1, True, "0", 1.0, -1, None, 0]  # True is no replica 1, nor "0" replica 0
    assert PsStatus.read({"done_replicas": done}, on_junk).done_replicas == [1, 0]
    assert told == [("done_replicas", done, "a list of worker indices")]


def test_a_bad_table_is_left_out_a_bad_counter_is_none_and_other_keys_are_not_read():
    told, on_junk = reader()
    tables = {"users": {"rows": 5, "bytes": "many", "evicted": -1, "bytes_per_row_bare": 48.0},
              "items": [1, 2], "ads": {"rows": 2.0}}
    read = PsStatus.read({"tables": tables}, on_junk).tables
    assert read == {"users": TableCounts(**{**dict.fromkeys(TABLE_COUNTS), "rows": 5}),
                    "ads": TableCounts(**{**dict.fromkeys(TABLE_COUNTS), "rows": 2})}
    expected = "an object of tables, each an object of counts"
    assert told == [("tables", {"users": {"bytes": "many", "evicted": -1}}, expected),
                    ("tables", {"items": [1, 2]}, expected)]


def test_from_meta_stays_strict():
    assert PsStatus.from_meta(PS.to_meta()) == PS
    assert PsStatus.from_meta({}) == PsStatus()  # absent: the defaults a worker relies on
    for bad in [{"global_step": "3"}, {"global_step": -1}, {"mode": "SYNC"}, {"tables": []}, {"role": "worker"},
                {"done_replicas": [True]}, {"uptime_s": "1"}, {"initialized": 1}]:
        with pytest.raises(InvalidArgumentError):
            PsStatus.from_meta(bad)
    assert WorkerStatus.from_meta(WORKER.to_meta()) == WORKER
    with pytest.raises(InvalidArgumentError, match="'loss' must be a finite number"):
        WorkerStatus.from_meta({**WORKER.to_meta(), "loss": float("nan")})
