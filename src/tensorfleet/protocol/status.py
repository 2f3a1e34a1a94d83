"""What a task answers to Status: ``PsStatus`` (a ps: what workers wait on, and what the launcher's monitor and
the dashboards show) and ``WorkerStatus`` (a worker: its training progress, for the monitor and the dashboards).

Two ways to read one:

* ``from_meta``, strict, for whoever depends on the answer (a worker waiting for its ps): a bad field
  raises ``InvalidArgumentError``;
* ``read``, lenient, for the launcher's monitor, which shows many tasks and must not let one bad answer
  hide the others' figures: a field of the wrong type or range is None (the others are kept), and
  ``on_junk(field, value, expected)`` is told of it. A field absent from the answer is None too, without
  a word (an older task, or a loss before the first step).

So every field is Optional: None is "not said" in a leniently read status. ``from_meta`` and the tasks
themselves fill every field a ps's reply has (but ``mode`` and ``sync``, None before Init).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Self

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.meta import count_field, flag_field
from tensorfleet.protocol.specs import Mode, SyncOptions

MAX_COUNT = 2 ** 63 - 1  # a count larger than this (or negative, or not whole) is junk
MAX_TEXT = 64  # a state or task name longer than this is junk
# A ps's counters per embedding table, as its Status reports them (and the monitor shows them).
TABLE_COUNTS = ("rows", "bytes", "rows_created", "admitted", "refused_updates", "evicted", "row_updates", "lookups")

OnJunk = Callable[[str, Any, str], None]  # (field, the bad value, what it should have been)
# A field's check: (value, report) -> the value, or None for junk; ``report(part)`` names a bad part of a
# value that is kept in part (a list with bad entries, a table with a bad counter).
Check = Callable[[Any, Callable[[Any], None]], Any]


def _count(value: Any) -> int | None:
    """``value`` as a count: a whole number from 0 to ``MAX_COUNT`` (an int, or a float with a whole value);
    None for anything else (a string, a bool, NaN, a fraction, a negative or huge number, a list ...)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return value
    return None


def _real(value: Any) -> float | None:
    """``value`` as a finite float (a loss, an age); None for anything else (NaN and infinities included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return value if math.isfinite(value) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_TEXT else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _one_of(*allowed: str) -> Callable[[Any], str | None]:
    return lambda value: value if isinstance(value, str) and value in allowed else None


def _sync(value: Any) -> SyncOptions | None:
    try:
        return SyncOptions.from_meta(value)
    except InvalidArgumentError:
        return None


def _indices(value: Any, report: Callable[[Any], None]) -> list[int] | None:
    """Replica ids: a bad one is left out (True is no replica 1, nor is "0"), the list reported once."""
    if not isinstance(value, list):
        return None
    indices = [i for i in value if type(i) is int and 0 <= i <= MAX_COUNT]
    if len(indices) != len(value):
        report(value)
    return indices


@dataclass(frozen=True)
class TableCounts:
    """One embedding table's counts on one ps shard, as its Status tells them (from the shard's last
    initialization or restore); None: a counter a lenient read found to be junk. ``bytes_per_row``: what one
    row costs there ("bare", "held", "map"), the ps's own figures, which a lenient read leaves out."""

    rows: int | None = 0
    bytes: int | None = 0
    rows_created: int | None = 0
    admitted: int | None = 0
    refused_updates: int | None = 0
    evicted: int | None = 0
    row_updates: int | None = 0
    lookups: int | None = 0
    bytes_per_row: dict[str, float] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        """On the wire, flat: the counts, and ``bytes_per_row_<part>``."""
        return {**{name: getattr(self, name) for name in TABLE_COUNTS},
                **{f"bytes_per_row_{part}": cost for part, cost in self.bytes_per_row.items()}}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], table: str = "") -> "TableCounts":
        """Strict: a counter absent is None (not told), a bad one raises ``InvalidArgumentError`` naming the table."""
        if not isinstance(meta, Mapping):
            raise InvalidArgumentError(f"Status 'tables' must map a table to its counters, got {meta!r:.60}")
        counts = {name: count_field(meta, name, f"Status table {table!r}") if name in meta else None
                  for name in TABLE_COUNTS}
        costs = {key.removeprefix("bytes_per_row_"): float(value) for key, value in meta.items()
                 if key.startswith("bytes_per_row_") and isinstance(value, (int, float)) and not isinstance(value, bool)}
        return cls(**counts, bytes_per_row=costs)

    @classmethod
    def read(cls, meta: Mapping[str, Any], report: Callable[[Any], None]) -> "TableCounts":
        """Lenient: a counter that is not a count is None (and reported); other keys are not read."""
        checked = {key: _count(meta.get(key)) for key in TABLE_COUNTS}
        bad = {key: meta[key] for key, count in checked.items() if count is None and meta.get(key) is not None}
        if bad:
            report(bad)
        return cls(**checked)


def _tables(value: Any, report: Callable[[Any], None]) -> dict[str, TableCounts] | None:
    """A ps's tables (name -> its ``TableCounts``): a table whose counters are not an object is left out,
    a counter that is not a count is None; other keys (``bytes_per_row_*``) are not read."""
    if not isinstance(value, dict):
        return None
    tables = {}
    for table, counters in value.items():
        if not isinstance(counters, dict):
            report({table: counters})
            continue
        tables[str(table)] = TableCounts.read(counters, lambda bad, table=table: report({table: bad}))
    return tables


MAX_METRICS = 32  # a task reports at most this many final metrics


def check_metric_name(name: Any) -> str:
    """A metric's name as a script may report it: a short identifier-like text (``accuracy``, ``test_rmse``,
    ``auc@10``), so that every view shows it as written.

    Raises:
        InvalidArgumentError: anything else, with what a name may be.
    """
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TEXT or not name.isprintable() or " " in name:
        raise InvalidArgumentError(f"a metric's name must be printable text of 1-{MAX_TEXT} characters without "
                                   f"spaces, got {name!r:.80}")
    return name


def _metrics(value: Any, report: Callable[[Any], None]) -> dict[str, float] | None:
    """A task's final metrics (name -> a finite number): a bad entry is left out and reported, the rest kept;
    more than ``MAX_METRICS`` is junk as a whole."""
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        return None
    metrics = {}
    for name, number in value.items():
        checked = _real(number)
        try:
            check_metric_name(name)
        except InvalidArgumentError:
            checked = None
        if checked is None:
            report({name: number})
        else:
            metrics[name] = checked
    return metrics


def _whole(check: Callable[[Any], Any]) -> Check:
    """A check of a value that is either good or junk as a whole."""
    return lambda value, report: check(value)


def _reporter(on_junk: OnJunk, name: str, expected: str) -> Callable[[Any], None]:
    return lambda value: on_junk(name, value, expected)


_COUNT = (_whole(_count), f"a whole number from 0 to {MAX_COUNT}")
_REAL = (_whole(_real), "a finite number")
_TEXT = (_whole(_text), f"a string of at most {MAX_TEXT} characters")


class _Status:
    """What ``PsStatus`` and ``WorkerStatus`` share: the lenient ``read``, from each field's check."""

    CHECKS: ClassVar[dict[str, tuple[Check, str]]]  # every field: its check, and what it must be

    @classmethod
    def read(cls, meta: Any, on_junk: OnJunk) -> Self:
        """``meta`` (a Status answer, data from the network) with each field checked: junk is None, and
        ``on_junk(field, value, expected)`` is called for it (more than once for a field bad in several parts);
        an answer that is not an object reads as one that said nothing."""
        if not isinstance(meta, Mapping):
            on_junk("status", meta, "an object")
            meta = {}
        values = {}
        for name, (check, expected) in cls.CHECKS.items():
            value = meta.get(name)
            if value is None:  # absent, or not known yet (no loss before the first step): not junk
                values[name] = None
                continue
            report = _reporter(on_junk, name, expected)
            values[name] = check(value, report)
            if values[name] is None:
                report(value)
        return cls(**values)

    @classmethod
    def unknown(cls) -> Self:
        """A status of which nothing is known: what a task that never answered shows."""
        return cls(**dict.fromkeys(cls.CHECKS))


@dataclass(frozen=True)
class PsStatus(_Status):
    """Status of a ps: what workers wait on (``initialized``, ``data_port``, the job's ``mode`` and ``sync``),
    and what the launcher's monitor and the dashboards show (steps, counters, tables, membership).

    The counters (``rows_created``, ``evicted``, ``admitted`` of a table, the push counts) count from the
    shard's last initialization or restore: a restore starts them again."""

    initialized: bool | None = False
    mode: str | None = None  # "async", "sync"; None before Init
    global_step: int | None = 0
    applied_updates: int | None = 0
    dropped_stale: int | None = 0
    dropped_duplicate: int | None = 0
    num_variables: int | None = 0
    num_bytes: int | None = 0
    initial_updates: int | None = 0  # applied_updates at the last initialization (a restored checkpoint's count)
    accepted_pushes: int | None = 0  # pushes taken for the first time since then (applied, or offered to a sync step)
    retried_pushes: int | None = 0  # pushes received again after a lost reply: recognized, not applied twice
    rejected_nonfinite: int | None = 0  # pushes refused for NaN/Inf gradients
    tables: dict[str, TableCounts] | None = field(default_factory=dict)  # per embedding table of the shard
    task: str | None = ""
    role: str | None = "ps"
    pid: int | None = 0
    uptime_s: float | None = 0.0
    state: str | None = "running"  # "running", or "done" once every worker said Done
    done_replicas: list[int] | None = field(default_factory=list)  # the replica ids that said Done
    workers_done: int | None = 0
    num_workers: int | None = 0
    sync: SyncOptions | None = None  # the job's (the chief's), once initialized in sync mode
    data_port: int | None = 0  # where Pull, Push, Lookup, Fence and Snapshot travel
    auth_refused: int | None = 0  # calls refused for a missing or wrong token

    CHECKS: ClassVar[dict[str, tuple[Check, str]]] = {
        "initialized": (_whole(_flag), "true or false"),
        "mode": (_whole(_one_of(Mode.SYNC, Mode.ASYNC)), f"'{Mode.SYNC}' or '{Mode.ASYNC}'"),
        **dict.fromkeys(("global_step", "applied_updates", "dropped_stale", "dropped_duplicate", "num_variables",
                         "num_bytes", "initial_updates", "accepted_pushes", "retried_pushes", "rejected_nonfinite"),
                        _COUNT),
        "tables": (_tables, "an object of tables, each an object of counts"),
        "task": _TEXT,
        "role": (_whole(_one_of("ps")), "'ps'"),
        "pid": _COUNT,
        "uptime_s": _REAL,
        "state": _TEXT,
        "done_replicas": (_indices, "a list of worker indices"),
        "workers_done": _COUNT,
        "num_workers": _COUNT,
        "sync": (_whole(_sync), "the job's sync options"),
        "data_port": _COUNT,
        "auth_refused": _COUNT,
    }

    def to_meta(self) -> dict[str, Any]:
        meta = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        meta["sync"] = self.sync.to_meta() if self.sync is not None else None
        meta["tables"] = ({name: counts.to_meta() for name, counts in self.tables.items()}
                          if self.tables is not None else None)
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "PsStatus":
        """Strict: a field absent has its default, a bad one raises ``InvalidArgumentError``."""
        if not isinstance(meta, Mapping) or meta.get("role", "ps") != "ps":
            raise InvalidArgumentError(f"Status: not a ps's status: {meta!r:.80}")
        counts = {name: count_field(meta, name, "Status") for name, check in cls.CHECKS.items()
                  if check is _COUNT and name in meta}
        mode, sync, tables = meta.get("mode"), meta.get("sync"), meta.get("tables", {})
        if mode not in (None, *(m.value for m in Mode)):
            raise InvalidArgumentError(f"Status 'mode' must be one of {[m.value for m in Mode]} or null, got "
                                       f"{mode!r:.30}")
        if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
            raise InvalidArgumentError(f"Status 'tables' must map a table to its counters, got {tables!r:.60}")
        tables = {str(name): TableCounts.from_meta(counts, str(name)) for name, counts in tables.items()}
        done = meta.get("done_replicas", [])
        if not isinstance(done, list) or not all(type(r) is int for r in done):
            raise InvalidArgumentError(f"Status 'done_replicas' must be a list of replica ids, got {done!r:.60}")
        uptime = meta.get("uptime_s", 0.0)
        if isinstance(uptime, bool) or not isinstance(uptime, (int, float)):
            raise InvalidArgumentError(f"Status 'uptime_s' must be a number, got {uptime!r:.30}")
        return cls(**{**counts, "initialized": flag_field(meta, "initialized", "Status"), "mode": mode,
                      "tables": tables, "task": str(meta.get("task", "")), "state": str(meta.get("state", "running")),
                      "done_replicas": done, "uptime_s": float(uptime),
                      "sync": SyncOptions.from_meta(sync) if sync is not None else None})


@dataclass(frozen=True)
class WorkerStatus(_Status):
    """Status of a worker (or the chief): its training progress, as its training loop records it
    (``tensorfleet.worker.status.TaskStatus``); only the launcher's monitor and the dashboards read it."""

    task: str | None = None
    role: str | None = None  # "worker", or "chief"
    state: str | None = None  # "starting" -> "training" -> "done", or "failed": training raised
    pid: int | None = None
    uptime_s: float | None = None
    local_step: int | None = None  # steps this worker pushed
    global_step: int | None = None  # the last one the ps told it
    dropped_gradients: int | None = None
    loss: float | None = None  # the last step's; None before the first
    examples: int | None = None  # trained on, so far
    target_step: int | None = None  # the global step training stops at, once known
    unique_ids: int | None = None  # embedding tables: unique ids in the last push (None: no tables)
    last_step_age_s: float | None = None  # None before the first step
    # what the script measured of its model (accuracy, RMSE, AUC, ...): tfl.report_metrics; None before any
    metrics: dict[str, float] | None = None
    auth_refused: int | None = None  # calls refused for a missing or wrong token (None: no status server yet)

    CHECKS: ClassVar[dict[str, tuple[Check, str]]] = {
        "task": _TEXT,
        "role": (_whole(_one_of("worker", "chief")), "'worker' or 'chief'"),
        "state": _TEXT,
        "pid": _COUNT,
        "uptime_s": _REAL,
        **dict.fromkeys(("local_step", "global_step", "dropped_gradients"), _COUNT),
        "loss": _REAL,
        **dict.fromkeys(("examples", "target_step", "unique_ids"), _COUNT),
        "last_step_age_s": _REAL,
        "metrics": (_metrics, f"an object of at most {MAX_METRICS} metrics, each a name and a finite number"),
        "auth_refused": _COUNT,
    }

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "WorkerStatus":
        """Strict: a field absent is None, a bad one raises ``InvalidArgumentError``."""
        def refuse(name: str, value: Any, expected: str) -> None:
            raise InvalidArgumentError(f"Status {name!r} must be {expected}, got {value!r:.50}")

        return cls.read(meta, refuse)
