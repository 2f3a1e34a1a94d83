"""The fleet picture in Prometheus' text format, for ``/metrics``.

The picture is already the state of the fleet, so there is nothing to
accumulate between scrapes: each scrape builds a fresh ``CollectorRegistry``
holding one collector over that scrape's picture, and prometheus_client writes
the text.  Values that are null in the picture (no target, no loss yet, a task
that never answered) are left out rather than exported as 0, which would read
as a real measurement.

Counters here (restarts, dropped stale gradients) are counts kept by the
launcher and the ps; they are exported as counters because they only grow for
the life of one launcher.

A job with embedding tables also gets one series per (ps task, table) for the
shard's rows, bytes and rows created per second (``tensorfleet_table_*``), and
each worker's unique ids in its last push (``tensorfleet_unique_ids``); a job
without tables gets none of these families.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tensorfleet.dashboard.picture import FleetPicture

__all__ = ["CONTENT_TYPE", "JOB_STATES", "TASK_STATES", "PictureCollector", "render_metrics"]

CONTENT_TYPE: str = CONTENT_TYPE_LATEST

JOB_STATES: tuple[str, ...] = ("running", "succeeded", "failed", "stopped")
TASK_STATES: tuple[str, ...] = ("starting", "running", "restarting", "done", "failed", "stopped", "unreachable",
                                "refused")

_TASK_LABELS = ["task", "role"]
_TABLE_LABELS = ["task", "table"]  # a ps shard's part of an embedding table (the role is always ps)


def _number(value: float | None) -> float | None:
    """``value`` as a float; None (unknown) stays None, and is left out."""
    return None if value is None else float(value)


def _states(current: str | None, known: tuple[str, ...]) -> list[tuple[str, float]]:
    """The enum pattern: one series per state, 1 for the current one; an unknown state gets a series too."""
    states = list(known) + ([current] if current and current not in known else [])
    return [(state, 1.0 if state == current else 0.0) for state in states]


class PictureCollector:
    """A prometheus_client collector over one picture (``tensorfleet.dashboard.picture``)."""

    def __init__(self, picture: FleetPicture) -> None:
        self._job = picture.job
        self._tasks = picture.tasks

    def collect(self) -> Iterator[Metric]:
        yield from self._job_metrics()
        yield from self._task_metrics()
        yield from self._table_metrics()

    def _job_metrics(self) -> Iterator[Metric]:
        job = self._job
        info = GaugeMetricFamily("tensorfleet_job_info", "The job being run; always 1.", labels=["name", "mode"])
        info.add_metric([job.name or "", job.mode or ""], 1.0)
        yield info

        state = GaugeMetricFamily("tensorfleet_job_state", "1 for the job's current state.", labels=["state"])
        for name, value in _states(job.state, JOB_STATES):
            state.add_metric([name], value)
        yield state

        gauges = [
            ("tensorfleet_global_step", "global_step", "The job's global step, as the ps last reported it."),
            ("tensorfleet_target_step", "target_step", "The global step at which the job stops."),
            ("tensorfleet_examples_per_second", "examples_per_sec", "Training examples per second, all workers."),
            ("tensorfleet_steps_per_second", "steps_per_sec", "Global steps per second."),
            ("tensorfleet_eta_seconds", "eta_s", "Estimated seconds until the target step."),
            ("tensorfleet_elapsed_seconds", "elapsed_s", "Seconds since the job started."),
        ]
        for metric, key, doc in gauges:
            value = _number(getattr(job, key))
            if value is not None:
                yield GaugeMetricFamily(metric, doc, value=value)

        reported = GaugeMetricFamily("tensorfleet_job_metric", "What the job's script reported of its model "
                                     "(tfl.report_metrics: accuracy, RMSE, AUC ...), by name.", labels=["name"])
        for name, value in (job.metrics or {}).items():
            reported.add_metric([name], float(value))
        yield reported

        counters = [
            ("tensorfleet_dropped_stale_gradients", "dropped_stale", "Gradients dropped as stale (sync mode)."),
            ("tensorfleet_job_restarts", "restarts", "Task restarts in this job, all tasks."),
        ]
        for metric, key, doc in counters:
            value = _number(getattr(job, key))
            if value is not None:
                yield CounterMetricFamily(metric, doc, value=value)

    def _task_metrics(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tensorfleet_task_up", "1 when the task is running, else 0.", labels=_TASK_LABELS)
        state = GaugeMetricFamily(
            "tensorfleet_task_state", "1 for the task's current state.", labels=[*_TASK_LABELS, "state"])
        restarts = CounterMetricFamily(
            "tensorfleet_task_restarts", "Times the launcher restarted the task.", labels=_TASK_LABELS)
        gauges = {
            "step": GaugeMetricFamily(
                "tensorfleet_task_step", "A worker's local step, or the updates a ps shard applied.",
                labels=_TASK_LABELS),
            "global_step": GaugeMetricFamily(
                "tensorfleet_task_global_step", "The global step the task last saw.", labels=_TASK_LABELS),
            "loss": GaugeMetricFamily("tensorfleet_task_loss", "The worker's last loss.", labels=_TASK_LABELS),
            "examples_per_sec": GaugeMetricFamily(
                "tensorfleet_task_examples_per_second", "The worker's examples per second.", labels=_TASK_LABELS),
            "heartbeat_age_s": GaugeMetricFamily(
                "tensorfleet_task_heartbeat_age_seconds", "Seconds since the task last answered its status RPC.",
                labels=_TASK_LABELS),
        }
        for task in self._tasks:
            labels = [task.name or "", task.role or ""]
            current = task.state
            up.add_metric(labels, 1.0 if current == "running" else 0.0)
            for name, value in _states(current, TASK_STATES):
                state.add_metric([*labels, name], value)
            count = _number(task.restarts)
            if count is not None:
                restarts.add_metric(labels, count)
            for key, family in gauges.items():
                value = _number(getattr(task, key))
                if value is not None:
                    family.add_metric(labels, value)
        yield up
        yield state
        yield restarts
        yield from gauges.values()


    def _table_metrics(self) -> Iterator[Metric]:
        """Each ps shard's part of each embedding table, and each worker's unique ids; for a job without
        tables (no ps reported any, no worker counted ids) not even the families' help lines."""
        gauges = {
            "rows": GaugeMetricFamily(
                "tensorfleet_table_rows", "Rows of the embedding table that the ps shard holds.", labels=_TABLE_LABELS),
            "bytes": GaugeMetricFamily(
                "tensorfleet_table_bytes", "Bytes the ps shard holds for the embedding table (rows, optimizer "
                "slots and id map, as allocated).", labels=_TABLE_LABELS),
            "rows_per_sec": GaugeMetricFamily(
                "tensorfleet_table_rows_created_per_second",
                "Rows of the embedding table that the ps shard creates per second.", labels=_TABLE_LABELS),
            "admitted": CounterMetricFamily(
                "tensorfleet_table_admitted", "New ids the ps shard gave a row (admission).", labels=_TABLE_LABELS),
            "refused_updates": CounterMetricFamily(
                "tensorfleet_table_refused_updates", "Row gradients the ps shard dropped: their id was not "
                "admitted yet.", labels=_TABLE_LABELS),
            "evicted": CounterMetricFamily(
                "tensorfleet_table_evicted", "Rows the ps shard evicted (TTL, max_rows, memory budget).",
                labels=_TABLE_LABELS),
            "traffic_share": GaugeMetricFamily(
                "tensorfleet_table_traffic_share", "The ps shard's part of the table's row updates and lookups "
                "since it started (a hot shard is far above 1 / shards).", labels=_TABLE_LABELS),
            "row_updates": CounterMetricFamily(
                "tensorfleet_table_row_updates", "Row gradients the ps shard applied.", labels=_TABLE_LABELS),
            "lookups": CounterMetricFamily(
                "tensorfleet_table_lookups", "Ids the ps shard was asked for.", labels=_TABLE_LABELS),
        }
        unique_ids = GaugeMetricFamily(
            "tensorfleet_unique_ids", "Unique ids (all embedding tables) in the worker's last push.",
            labels=_TASK_LABELS)
        has_tables = False
        for task in self._tasks:
            name = task.name or ""
            count = _number(task.unique_ids)
            if count is not None:
                has_tables = True
                unique_ids.add_metric([name, task.role or ""], count)
            for table, part in (task.tables or {}).items():
                has_tables = True
                for key, family in gauges.items():
                    value = _number(getattr(part, key))
                    if value is not None:
                        family.add_metric([name, str(table)], value)
        if has_tables:
            yield from gauges.values()
            yield unique_ids


def render_metrics(picture: FleetPicture) -> bytes:
    """The picture in Prometheus' text format (serve it with ``CONTENT_TYPE``).

    Example:
        >>> from tensorfleet.dashboard.picture import JobPicture
        >>> text = render_metrics(FleetPicture(JobPicture(global_step=7))).decode()
        >>> "tensorfleet_global_step 7.0" in text
        True
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PictureCollector(picture))
    return generate_latest(registry)
