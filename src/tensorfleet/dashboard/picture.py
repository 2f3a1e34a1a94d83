"""The fleet picture as types: what every view of a running job reads (the progress line, the dashboard page,
``/metrics``, the job service's pages).

``FleetMonitor.picture()`` builds one from the tasks' Status answers, ``SlurmLauncher.picture()`` from what Slurm
and the ranks' logs say. ``to_json()`` is the dashboard's ``/api/status`` and the job service's ``picture.json``
(every field, null where unknown); ``FleetPicture.read`` takes one back from JSON leniently, as data from a file
or another version: a field of the wrong type is None, an unknown one is dropped, so a view never fails on it.

A "picture", not a "snapshot": that is a ps shard's state taken for a checkpoint (the Snapshot RPC).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["FleetPicture", "HistoryPoint", "JobPicture", "TablePart", "TaskPicture"]


@dataclass
class TablePart:
    """A ps shard's part of one embedding table."""

    rows: int | None = None
    bytes: int | None = None
    rows_per_sec: float | None = None  # rows created per second
    admitted: int | None = None  # new ids given a row (admission)
    refused_updates: int | None = None  # row gradients dropped: their id was not admitted yet
    evicted: int | None = None
    row_updates: int | None = None
    lookups: int | None = None
    traffic_share: float | None = None  # this shard's part of the table's row updates and lookups


@dataclass
class TaskPicture:
    """One task: who it is, how it is, and its own figures (a ps's step is the updates it applied)."""

    name: str | None = None  # "ps:0", "worker:1"
    role: str | None = None  # "ps", "chief", "worker"
    address: str | None = None
    state: str | None = None  # starting, running, restarting, done, failed, stopped, unreachable, refused
    pid: int | None = None
    restarts: int | None = None
    step: int | None = None
    global_step: int | None = None  # ps:0's (or a sync shard's); a worker's is the last it was told
    loss: float | None = None
    examples_per_sec: float | None = None
    heartbeat_age_s: float | None = None
    exit_code: int | None = None
    tables: dict[str, TablePart] | None = None  # a ps with embedding tables
    unique_ids: int | None = None  # a worker of a model with tables: unique ids in its last push
    metrics: dict[str, float] | None = None  # what the task's script reported (tfl.report_metrics)
    problem: str | None = None  # why the task tells nothing (it refuses the monitor; how srun said it ended)


@dataclass
class JobPicture:
    """The job as a whole."""

    name: str | None = None
    mode: str | None = None  # "sync", "async"
    state: str | None = None  # running, succeeded, failed, stopped (Slurm's: also starting, restarting)
    global_step: int | None = None
    target_step: int | None = None
    steps_per_sec: float | None = None
    examples_per_sec: float | None = None
    eta_s: float | None = None
    dropped_stale: int | None = None
    elapsed_s: float | None = None
    restarts: int | None = None
    table_rows: int | None = None  # embedding tables: rows of all shards
    rows_per_sec: float | None = None
    problem: str | None = None  # what the views say above everything (no token; no live figures on Slurm)
    metrics: dict[str, float] | None = None  # the job's final metrics (the chief's first)


@dataclass
class HistoryPoint:
    """One poll's figures, for the charts."""

    t: float | None = None  # seconds since the monitor started
    global_step: int | None = None
    loss: float | None = None  # the workers' mean
    examples_per_sec: float | None = None
    steps_per_sec: float | None = None


@dataclass
class FleetPicture:
    """The job, each task (ps first, in the cluster's order), and a bounded history (oldest first)."""

    job: JobPicture = field(default_factory=JobPicture)
    tasks: list[TaskPicture] = field(default_factory=list)
    history: list[HistoryPoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict: every field, None where unknown (NaN and infinities are the server's to say).

        Field by field rather than ``dataclasses.asdict``, which deep-copies: a picture of a long job holds
        ``HISTORY_POINTS`` points, and the dashboard and the job service's runner each ask for one a second."""
        return {"job": _json(self.job), "tasks": [_json(task) for task in self.tasks],
                "history": [_json(point) for point in self.history]}

    @classmethod
    def read(cls, value: Any) -> "FleetPicture":
        """A picture from JSON (a file, an older or newer version): what is not of its field's type is None."""
        value = value if isinstance(value, Mapping) else {}
        tasks, history = value.get("tasks"), value.get("history")
        return cls(job=_read(JobPicture, value.get("job")),
                   tasks=[_read(TaskPicture, t) for t in tasks if isinstance(t, Mapping)]
                   if isinstance(tasks, list) else [],
                   history=[_read(HistoryPoint, p) for p in history if isinstance(p, Mapping)]
                   if isinstance(history, list) else [])


def _json(record: JobPicture | TaskPicture | HistoryPoint) -> dict[str, Any]:
    """One record as a new dict (a task's tables and metrics new too: the caller may change what it gets)."""
    shown = dict(vars(record))
    if isinstance(record, TaskPicture):
        shown["tables"] = None if record.tables is None else {t: dict(vars(p)) for t, p in record.tables.items()}
    if shown.get("metrics") is not None:
        shown["metrics"] = dict(shown["metrics"])
    return shown


def _read(kind: type, value: Any) -> Any:
    """One of the records above from a mapping, field by field (see ``FleetPicture.read``)."""
    value = value if isinstance(value, Mapping) else {}
    return kind(**{name: read(value.get(name)) for name, read in _readers(kind)})


def _readers(kind: type) -> list[tuple[str, Callable[[Any], Any]]]:
    """Each field of ``kind`` with the function that reads it (made once per kind: a picture holds many)."""
    readers = _READERS.get(kind)
    if readers is None:
        readers = _READERS[kind] = [(name, _reader(hint)) for name, hint in typing.get_type_hints(kind).items()]
    return readers


_READERS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


def _reader(hint: Any) -> Callable[[Any], Any]:
    """What reads a field of type ``hint`` (``X | None``): its value if of X (a bool is no number), else None;
    the tables' and metrics' mappings entry by entry."""
    kind = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if kind is int:
        return lambda value: value if type(value) is int else None
    if kind is float:
        return lambda value: value if type(value) in (int, float) else None
    if kind is str:
        return lambda value: value if type(value) is str else None
    entry = typing.get_args(kind)[1]
    if entry is float:  # metrics: name -> number
        return lambda value: ({str(k): v for k, v in value.items() if type(v) in (int, float)}
                              if isinstance(value, Mapping) else None)
    return lambda value: ({str(k): _read(entry, v) for k, v in value.items() if isinstance(v, Mapping)}
                          if isinstance(value, Mapping) else None)  # tables
