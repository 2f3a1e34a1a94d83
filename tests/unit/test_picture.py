"""The fleet picture's types: ``to_json`` is every field, ``read`` takes one back from JSON and drops junk."""

from __future__ import annotations

import dataclasses
import json

from tensorfleet.dashboard.picture import FleetPicture, HistoryPoint, JobPicture, TablePart, TaskPicture


def _picture() -> FleetPicture:
    return FleetPicture(
        JobPicture(name="mnist", mode="sync", state="running", global_step=1200, target_step=10000,
                   steps_per_sec=512.5, dropped_stale=3, restarts=1, table_rows=1500, metrics={"accuracy": 0.97}),
        [TaskPicture(name="ps:0", role="ps", address="127.0.0.1:1", state="running", pid=10, restarts=0,
                     step=1200, global_step=1200, tables={"users": TablePart(rows=1000, bytes=4096, lookups=7,
                                                                             traffic_share=1.0)}),
         TaskPicture(name="worker:0", role="chief", state="restarting", loss=0.25, unique_ids=300,
                     problem="refuses this dashboard")],
        [HistoryPoint(t=1.5, global_step=1100, loss=0.3)])


def test_json_has_every_field_and_reads_back_equal():
    picture = _picture()
    shown = json.loads(json.dumps(picture.to_json(), allow_nan=False))
    assert shown["job"]["eta_s"] is None and shown["job"]["global_step"] == 1200  # unknown fields are null
    assert shown["tasks"][0]["tables"]["users"] == {"rows": 1000, "bytes": 4096, "rows_per_sec": None,
                                                    "admitted": None, "refused_updates": None, "evicted": None,
                                                    "row_updates": None, "lookups": 7, "traffic_share": 1.0}
    assert shown["tasks"][1]["tables"] is None
    assert shown["history"] == [{"t": 1.5, "global_step": 1100, "loss": 0.3, "examples_per_sec": None,
                                 "steps_per_sec": None}]
    assert FleetPicture.read(shown) == picture
    assert picture.to_json() == dataclasses.asdict(picture)  # every field, nested ones too


def test_json_is_a_copy_a_caller_may_change():
    picture = _picture()
    shown = picture.to_json()
    shown["job"]["metrics"]["accuracy"] = 0.0
    shown["tasks"][0]["tables"]["users"]["rows"] = 0
    shown["history"][0]["loss"] = None
    assert picture == _picture()


def test_read_takes_junk_as_absent_and_drops_unknown_fields():
    junk = {"job": {"name": 7, "global_step": "12", "steps_per_sec": True, "restarts": 2.5, "metrics": {
                "accuracy": 0.9, "auc": "high", "ok": False}, "from_a_newer_version": 1},
            "tasks": [{"name": "ps:0", "step": 1.5, "loss": 3, "tables": {"users": {"rows": "many", "bytes": 8},
                                                                           "items": [1, 2]}},
                      "not a task", {"name": "worker:0", "tables": "abc", "metrics": [1]}],
            "history": [{"t": "now", "global_step": 5}, None]}
    picture = FleetPicture.read(junk)
    assert picture.job == JobPicture(metrics={"accuracy": 0.9})  # a float field takes a whole number; no bools
    assert picture.tasks == [TaskPicture(name="ps:0", loss=3, tables={"users": TablePart(bytes=8)}),
                             TaskPicture(name="worker:0")]
    assert picture.history == [HistoryPoint(global_step=5)]


def test_read_of_anything_but_a_picture_is_an_empty_one():
    for value in (None, "abc", [1, 2], {"job": "x", "tasks": {"a": 1}, "history": 7}):
        assert FleetPicture.read(value) == FleetPicture()
