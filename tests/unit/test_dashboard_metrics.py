"""The dashboard's /metrics text: parses back as Prometheus text, with the picture's values and labels."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from tensorfleet.dashboard.metrics import TASK_STATES, render_metrics
from tensorfleet.dashboard.picture import FleetPicture


def _picture() -> dict:
    return {
        "job": {"name": "mnist_mlp", "mode": "sync", "state": "running", "global_step": 1234,
                "target_step": 10000, "steps_per_sec": 512.5, "examples_per_sec": 51250.0, "eta_s": 17.25,
                "dropped_stale": 3, "elapsed_s": 12.5, "restarts": 1},
        "tasks": [
            {"name": "ps:0", "role": "ps", "address": "127.0.0.1:41234", "state": "running", "pid": 100,
             "restarts": 0, "step": 1234, "global_step": 1234, "loss": None, "examples_per_sec": None,
             "heartbeat_age_s": 0.25, "exit_code": None},
            {"name": "worker:1", "role": "worker", "address": "127.0.0.1:41236", "state": "restarting",
             "pid": None, "restarts": 1, "step": 610, "global_step": 1230, "loss": 0.5,
             "examples_per_sec": 2500.0, "heartbeat_age_s": None, "exit_code": -9},
        ],
        "history": [{"t": 3.0, "global_step": 800, "loss": 0.41, "examples_per_sec": 50000.0, "steps_per_sec": 500.0}],
    }


def _samples(picture: dict) -> dict[str, list]:
    """Every sample by its name (counters keep their ``_total``), as parsed back from the text."""
    text = render_metrics(FleetPicture.read(picture)).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples: dict[str, list], metric: str, /, **labels: str) -> float:
    """The one sample of ``metric`` whose labels include ``labels``."""
    matches = [s.value for s in samples[metric] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, f"{metric}{labels}: {matches}"
    return matches[0]


def test_job_values():
    samples = _samples(_picture())
    assert _value(samples, "tensorfleet_global_step") == 1234
    assert _value(samples, "tensorfleet_target_step") == 10000
    assert _value(samples, "tensorfleet_steps_per_second") == 512.5
    assert _value(samples, "tensorfleet_examples_per_second") == 51250.0
    assert _value(samples, "tensorfleet_eta_seconds") == 17.25
    assert _value(samples, "tensorfleet_elapsed_seconds") == 12.5
    assert _value(samples, "tensorfleet_dropped_stale_gradients_total") == 3
    assert _value(samples, "tensorfleet_job_restarts_total") == 1
    assert _value(samples, "tensorfleet_job_info", name="mnist_mlp", mode="sync") == 1
    assert _value(samples, "tensorfleet_job_state", state="running") == 1
    assert _value(samples, "tensorfleet_job_state", state="failed") == 0


def test_counters_are_typed_as_counters():
    text = render_metrics(FleetPicture.read(_picture())).decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["tensorfleet_task_restarts"] == "counter"
    assert types["tensorfleet_dropped_stale_gradients"] == "counter"
    assert types["tensorfleet_global_step"] == "gauge"


def test_task_values_and_labels():
    samples = _samples(_picture())
    ps = {"task": "ps:0", "role": "ps"}
    worker = {"task": "worker:1", "role": "worker"}
    assert _value(samples, "tensorfleet_task_up", **ps) == 1
    assert _value(samples, "tensorfleet_task_up", **worker) == 0
    assert _value(samples, "tensorfleet_task_step", **ps) == 1234
    assert _value(samples, "tensorfleet_task_step", **worker) == 610
    assert _value(samples, "tensorfleet_task_global_step", **worker) == 1230
    assert _value(samples, "tensorfleet_task_loss", **worker) == 0.5
    assert _value(samples, "tensorfleet_task_examples_per_second", **worker) == 2500.0
    assert _value(samples, "tensorfleet_task_heartbeat_age_seconds", **ps) == 0.25
    assert _value(samples, "tensorfleet_task_restarts_total", **worker) == 1


def test_task_state_is_one_series_per_state_with_the_current_one_at_1():
    samples = _samples(_picture())
    states = {s.labels["state"]: s.value for s in samples["tensorfleet_task_state"] if s.labels["task"] == "worker:1"}
    assert set(states) == set(TASK_STATES)
    assert states["restarting"] == 1
    assert sum(states.values()) == 1


def test_an_unknown_state_gets_its_own_series():
    picture = _picture()
    picture["tasks"][0]["state"] = "rebalancing"
    samples = _samples(picture)
    assert _value(samples, "tensorfleet_task_state", task="ps:0", state="rebalancing") == 1
    assert _value(samples, "tensorfleet_task_state", task="ps:0", state="running") == 0


def test_null_values_are_skipped():
    samples = _samples(_picture())
    assert [s.labels["task"] for s in samples["tensorfleet_task_loss"]] == ["worker:1"]
    assert [s.labels["task"] for s in samples["tensorfleet_task_heartbeat_age_seconds"]] == ["ps:0"]
    assert [s.labels["task"] for s in samples["tensorfleet_task_examples_per_second"]] == ["worker:1"]

    picture = _picture()
    picture["job"].update(target_step=None, eta_s=None, steps_per_sec=None, examples_per_sec=None, mode=None)
    samples = _samples(picture)
    for name in ("tensorfleet_target_step", "tensorfleet_eta_seconds", "tensorfleet_steps_per_second",
                 "tensorfleet_examples_per_second"):
        assert name not in samples
    assert _value(samples, "tensorfleet_job_info", name="mnist_mlp", mode="") == 1


def test_label_values_are_escaped():
    picture = _picture()
    picture["tasks"][0]["name"] = 'ps:"0"\\\n'
    samples = _samples(picture)
    assert _value(samples, "tensorfleet_task_up", task='ps:"0"\\\n') == 1


def test_a_nan_loss_is_exported_as_nan():
    picture = _picture()
    picture["tasks"][1]["loss"] = float("nan")
    samples = _samples(picture)
    assert math.isnan(_value(samples, "tensorfleet_task_loss", task="worker:1"))


def test_an_empty_picture_renders():
    samples = _samples({"job": {}, "tasks": [], "history": []})
    assert "tensorfleet_global_step" not in samples
    assert "tensorfleet_task_up" not in samples


def _picture_with_tables() -> dict:
    """Two ps shards holding parts of "users" and "items"; the worker's last push had 4096 unique ids."""
    picture = _picture()
    ps1 = {**picture["tasks"][0], "name": "ps:1", "address": "127.0.0.1:41235"}
    picture["tasks"].insert(1, ps1)
    picture["tasks"][0]["tables"] = {"users": {"rows": 120000, "bytes": 61440000, "rows_per_sec": 850.5},
                                     "items": {"rows": 3000, "bytes": 1536000, "rows_per_sec": 12.0}}
    ps1["tables"] = {"users": {"rows": 119000, "bytes": 60928000, "rows_per_sec": None},  # restarted: no rate yet
                     "items": {"rows": 2900, "bytes": 1484800, "rows_per_sec": 11.5}}
    picture["tasks"][2]["unique_ids"] = 4096
    picture["job"].update(table_rows=244900, rows_per_sec=874.0)
    return picture


def test_embedding_table_values_and_labels():
    samples = _samples(_picture_with_tables())
    assert _value(samples, "tensorfleet_table_rows", task="ps:0", table="users") == 120000
    assert _value(samples, "tensorfleet_table_rows", task="ps:1", table="items") == 2900
    assert _value(samples, "tensorfleet_table_bytes", task="ps:1", table="users") == 60928000
    assert _value(samples, "tensorfleet_table_rows_created_per_second", task="ps:0", table="users") == 850.5
    assert _value(samples, "tensorfleet_table_rows_created_per_second", task="ps:1", table="items") == 11.5
    assert _value(samples, "tensorfleet_unique_ids", task="worker:1", role="worker") == 4096
    assert {frozenset(s.labels.items()) for s in samples["tensorfleet_table_rows"]} == {
        frozenset({"task": task, "table": table}.items()) for task in ("ps:0", "ps:1") for table in ("users", "items")}
    # null is left out: the restarted shard's rate, the ps's unique ids
    assert len(samples["tensorfleet_table_rows_created_per_second"]) == 3
    assert [s.labels["task"] for s in samples["tensorfleet_unique_ids"]] == ["worker:1"]

    text = render_metrics(FleetPicture.read(_picture_with_tables())).decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    names = ("tensorfleet_table_rows", "tensorfleet_table_bytes", "tensorfleet_table_rows_created_per_second",
             "tensorfleet_unique_ids")
    assert {types[name] for name in names} == {"gauge"}


def test_a_job_without_tables_has_no_table_families():
    picture = _picture()
    for task in picture["tasks"]:
        task.update(tables=None, unique_ids=None)
    picture["job"].update(table_rows=None, rows_per_sec=None)
    text = render_metrics(FleetPicture.read(picture)).decode()
    assert "tensorfleet_table" not in text and "tensorfleet_unique_ids" not in text
    assert text == render_metrics(FleetPicture.read(_picture())).decode()  # as before the tables came
