"""A job's final metrics (``tfl.report_metrics``): checked where a script reports them, carried by its Status
(read leniently by the monitor: a bad entry left out, the rest kept), the job's taken from the chief first, and
shown by the launcher's summary, ``/metrics`` and the job service's jobs list and job page."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorfleet.dashboard.metrics import render_metrics
from tensorfleet.dashboard.picture import FleetPicture, TaskPicture
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.launch.monitor import job_metrics, metrics_text
from tensorfleet.protocol.status import MAX_METRICS, WorkerStatus
from tensorfleet.worker import status as worker_status
from tensorfleet.worker.status import TaskStatus, checked_metrics


def test_reported_metrics_travel_in_the_status_and_a_name_reported_again_is_replaced(monkeypatch):
    status = TaskStatus()
    monkeypatch.setattr(worker_status, "PROCESS_STATUS", status)
    assert status.as_status().metrics is None  # nothing reported yet
    worker_status.report_metrics(accuracy=0.9, val_loss=0.3)
    torch = pytest.importorskip("torch")
    worker_status.report_metrics(accuracy=torch.tensor(0.977))  # a one-element tensor is a number
    meta = status.as_meta()
    assert meta["metrics"] == {"accuracy": pytest.approx(0.977), "val_loss": 0.3}
    assert WorkerStatus.from_meta(meta).metrics == meta["metrics"]


@pytest.mark.parametrize("metrics, says", [
    ({"accuracy": math.nan}, "finite number"),
    ({"accuracy": "0.9"}, "finite number"),
    ({"accuracy": True}, "finite number"),
    ({"test accuracy": 0.9}, "without spaces"),
    ({"": 0.9}, "1-64 characters"),
    ({"x" * 65: 0.9}, "1-64 characters"),
    ({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, f"at most {MAX_METRICS} metrics"),
])
def test_a_bad_metric_is_refused_where_the_script_reports_it(metrics, says):
    status = TaskStatus()
    with pytest.raises(InvalidArgumentError, match=says):
        status.report(metrics=metrics)
    assert status.metrics == {}  # nothing of a refused report is kept


def test_a_tensor_of_several_values_is_no_metric():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match="finite number"):
        checked_metrics({"accuracy": worker_status._scalar(torch.tensor([0.9, 0.8]))})


def test_the_monitor_reads_metrics_leniently_keeping_the_good_ones():
    junk = []
    status = WorkerStatus.read({"metrics": {"auc": 0.8, "rmse": "high", "bad name": 1.0, "nan": math.nan}},
                               lambda *said: junk.append(said))
    assert status.metrics == {"auc": 0.8}
    assert len(junk) == 3
    assert WorkerStatus.read({"metrics": [0.8]}, lambda *said: junk.append(said)).metrics is None
    with pytest.raises(InvalidArgumentError, match="metrics"):
        WorkerStatus.from_meta({"metrics": {"rmse": "high"}})


def test_the_jobs_metrics_are_the_chiefs_then_names_only_others_reported():
    tasks = [TaskPicture(name="ps:0", role="ps", metrics=None),
             TaskPicture(name="worker:1", role="worker", metrics={"accuracy": 0.5, "auc": 0.7}),
             TaskPicture(name="worker:0", role="chief", metrics={"accuracy": 0.9})]
    assert job_metrics(tasks) == {"accuracy": 0.9, "auc": 0.7}
    assert job_metrics(tasks[:1]) is None
    assert metrics_text({"accuracy": 0.97714, "loss": 0.0001234, "rows": 123456.0}) == \
        "accuracy 0.9771, loss 0.0001234, rows 1.235e+05"


def test_metrics_are_exported_to_prometheus_by_name():
    picture = {"job": {"name": "j", "mode": "async", "state": "succeeded", "metrics": {"accuracy": 0.977}},
               "tasks": [], "history": []}
    text = render_metrics(FleetPicture.read(picture)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["tensorfleet_job_metric"].samples
    assert sample.labels == {"name": "accuracy"} and sample.value == pytest.approx(0.977)
