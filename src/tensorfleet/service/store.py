r"""The job service's memory: job records, their state machine and their event history, in SQLite.

The service is restarted (upgrades, crashes) while jobs run, and two service processes may end up
on one folder by mistake; this store is what lets a restarted service find its jobs again and what
makes "start this job" happen once. Every state change is a compare-and-set inside a
``BEGIN IMMEDIATE`` transaction (SQLite's write lock, which holds across processes), written
together with its event, so the history never disagrees with the state.

Jobs move only along ``TRANSITIONS``::

    queued -> starting -> running -> succeeded | failed | stopped | lost
       |          +-> failed | stopped | lost
       +-> stopped

A finished job is never revived: restarting one is a new record cloned from it (``restarted_from``
names the old one), so a record's history is one run.

Configs are validated with ``JobConfig.validate()``, which also checks that the script file exists
(relative paths against the current directory): a job whose script is missing is refused when it is
submitted, not when it is started. The caller (the service) should pass absolute script paths.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.config import FIELDS, JobConfig

SCHEMA_VERSION = 2


class JobState(enum.StrEnum):
    QUEUED = "queued"
    STARTING = "starting"  # claimed by a service, its supervisor being started
    RUNNING = "running"  # its supervisor runs (pid recorded)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by a user
    LOST = "lost"  # the service restarted and the supervisor was gone, with no exit recorded (reason says)


_S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.QUEUED: frozenset({_S.STARTING, _S.STOPPED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.FAILED, _S.STOPPED, _S.LOST}),
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.STOPPED, _S.LOST}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.STOPPED: frozenset(),
    _S.LOST: frozenset(),
}
TERMINAL = frozenset(state for state, nexts in TRANSITIONS.items() if not nexts)
ACTIVE = (_S.STARTING, _S.RUNNING)  # a supervisor process may exist
BACKENDS = ("local", "kubernetes", "ray", "slurm")


class JobNotFoundError(TensorfleetError):
    """No job has this id (ids are never reused)."""

    code = "NOT_FOUND"

    def __init__(self, job_id: int) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id


class JobStateError(TensorfleetError):
    """A transition the table forbids, or one from a state the job has already left (a stale read)."""

    code = "FAILED_PRECONDITION"


class JobStoreError(TensorfleetError):
    """The store's file cannot be used: not a job store, or written by a newer tensorfleet."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class JobRecord:
    """One job as stored. ``config`` is ``dataclasses.asdict`` of its JobConfig (JSON-able)."""

    id: int
    name: str
    owner: str
    config: dict[str, Any]
    state: JobState
    created_at: float  # seconds since the epoch
    updated_at: float
    started_at: float | None = None  # when it left the queue (entered starting)
    finished_at: float | None = None  # when it entered a terminal state
    pid: int | None = None  # the supervising process, for re-attaching after a service restart
    logdir: str | None = None  # where it actually writes (config.logdir, or the directory chosen at start)
    reason: str | None = None  # why it last changed state: exit reason, error text, why it was lost
    restarts: int = 0  # task restarts done by its supervisor
    restarted_from: int | None = None  # the job this one was cloned/restarted from
    backend: str = "local"  # what runs it: "local" processes, or "kubernetes"
    stop_requested: str | None = None  # who asked it to stop, once someone has (its runner reads it)
    workers_target: int | None = None  # the worker count a user scaled it to (its runner reads it)

    @property
    def job_config(self) -> JobConfig:
        return JobConfig(**self.config)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True)
class JobEvent:
    id: int
    job_id: int
    time: float
    kind: str  # "submitted", "state", "restart", "cloned", or what add_event was given
    text: str


_STATES_SQL = ", ".join(f"'{state.value}'" for state in JobState)
_SCHEMA = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    f"""CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        owner TEXT NOT NULL,
        config TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ({_STATES_SQL})),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        pid INTEGER,
        logdir TEXT,
        reason TEXT,
        restarts INTEGER NOT NULL DEFAULT 0,
        restarted_from INTEGER REFERENCES jobs(id),
        backend TEXT NOT NULL DEFAULT 'local',
        stop_requested TEXT,
        workers_target INTEGER)""",
    "CREATE INDEX jobs_by_state ON jobs (state, id)",
    """CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        text TEXT NOT NULL)""",
    "CREATE INDEX events_by_job ON events (job_id, id)",
    "CREATE TRIGGER events_no_update BEFORE UPDATE ON events BEGIN SELECT RAISE(ABORT, 'events are append-only'); END",
    "CREATE TRIGGER events_no_delete BEFORE DELETE ON events BEGIN SELECT RAISE(ABORT, 'events are append-only'); END",
    """CREATE TABLE users (
        name TEXT PRIMARY KEY,
        password TEXT NOT NULL,
        admin INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL)""",
    """CREATE TABLE tokens (
        digest TEXT PRIMARY KEY,
        user TEXT NOT NULL REFERENCES users(name) ON DELETE CASCADE,
        kind TEXT NOT NULL CHECK (kind IN ('session', 'api')),
        csrf TEXT,
        created_at REAL NOT NULL,
        expires_at REAL)""",
    f"INSERT INTO schema_version (version) VALUES ({SCHEMA_VERSION})",
)
_COLUMNS = ", ".join(f.name for f in dataclasses.fields(JobRecord))


class JobStore:
    """Jobs in the SQLite file ``path`` (created if missing).

    One connection guarded by a lock, shared by the threads of this process (a connection per thread
    would leak one per request thread of a threading web server; SQLite serializes writers anyway).
    Several JobStore objects, in one process or several, may open the same file: WAL lets readers
    run beside the writer, and ``BEGIN IMMEDIATE`` makes their writes take turns.
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                         check_same_thread=False)
        except sqlite3.Error as exc:
            raise JobStoreError(f"job store {str(self.path)!r} cannot be opened: {exc}") from None
        try:
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._init_schema()
        except BaseException as exc:
            self._conn.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise JobStoreError(f"job store {str(self.path)!r} cannot be opened: {exc}") from None
            raise

    def _init_schema(self) -> None:
        with self.write() as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables - {"sqlite_sequence"}:
                for statement in _SCHEMA:
                    conn.execute(statement)
                return
            row = conn.execute("SELECT max(version) FROM schema_version").fetchone() \
                if "schema_version" in tables else None
            if row is None or row[0] is None:
                raise JobStoreError(f"{str(self.path)!r} is a SQLite database but not a tensorfleet job store "
                                    f"(no schema version): point the service at another folder")
            if row[0] != SCHEMA_VERSION:
                newer = row[0] > SCHEMA_VERSION
                raise JobStoreError(
                    f"job store {str(self.path)!r} has schema version {row[0]}, "
                    f"{'newer than' if newer else 'older than'} this tensorfleet's ({SCHEMA_VERSION}): "
                    + ("upgrade tensorfleet, or point the service at another folder" if newer
                       else "no migration from it exists; point the service at another folder"))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "JobStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def now(self) -> float:
        """The store's clock (seconds since the epoch; tests give a fake one)."""
        return self._clock()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """The connection, for reads (accounts.py shares the database)."""
        with self._lock:
            yield self._conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, holding SQLite's write lock from its first statement (no stale reads)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # ----- reading

    def get(self, job_id: int) -> JobRecord:
        with self._lock:
            return self._get(self._conn, job_id)

    def list(self, state: JobState | str | None = None, owner: str | None = None) -> list[JobRecord]:
        """Jobs, oldest first, optionally only those in ``state`` and/or of ``owner``."""
        where, params = [], []
        if state is not None:
            where.append("state = ?")
            params.append(_state(state).value)
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        with self._lock:
            return self._select(self._conn, " AND ".join(where) or "1", params)

    def events(self, job_id: int) -> list[JobEvent]:
        """A job's history, oldest first."""
        with self._lock:
            self._get(self._conn, job_id)
            rows = self._conn.execute("SELECT id, job_id, time, kind, text FROM events WHERE job_id = ? ORDER BY id",
                                      (job_id,)).fetchall()
        return [JobEvent(*row) for row in rows]

    # ----- writing

    def submit(self, config: JobConfig | Mapping[str, Any], owner: str, name: str | None = None, *,
               backend: str = "local") -> JobRecord:
        """A new queued job. ``name`` (if given) replaces the config's name; the record's name is the
        config's job name. Raises ConfigError (nothing stored) for an invalid config."""
        job_config = _job_config(config)
        if name is not None:
            job_config = dataclasses.replace(job_config, name=name)
        return self._insert(job_config.validate(), owner, restarted_from=None, backend=_backend(backend),
                            text=f"queued by {owner}")

    def clone(self, job_id: int, owner: str, *, backend: str | None = None, **changes: Any) -> JobRecord:
        """A new queued job with ``job_id``'s settings and ``changes`` (JobConfig fields), whatever state
        ``job_id`` is in; ``restarted_from`` names the source. A restart is a clone without changes."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(FIELDS))}")
        source = self.get(job_id)
        job_config = JobConfig(**{**source.config, **changes}).validate()
        changed = ", ".join(f"{k}={v!r}" for k, v in sorted(changes.items()))
        return self._insert(job_config, owner, restarted_from=source.id,
                            backend=_backend(backend or source.backend),
                            text=f"cloned from job {source.id} by {owner}" + (f" with {changed}" if changed else ""))

    def request_stop(self, job_id: int, by: str) -> JobRecord:
        """``by`` asks the job to stop: a queued job is stopped at once; an active one is marked, for its
        backend to act on (the caller signals it). Raises JobStateError for a finished job."""
        with self.write() as conn:
            job = self._get(conn, job_id)
            if job.state is JobState.QUEUED:
                return self._move(conn, job, JobState.STOPPED, expected=JobState.QUEUED,
                                  reason=f"stopped by {by} before it started")
            if job.finished:
                raise JobStateError(f"job {job_id} has already finished ({job.state}): nothing to stop")
            now = self._clock()
            conn.execute("UPDATE jobs SET stop_requested = ?, updated_at = ? WHERE id = ?", (by, now, job_id))
            self._event(conn, job_id, now, "stop", f"stop requested by {by}")
            return self._get(conn, job_id)

    def set_workers_target(self, job_id: int, workers: int, by: str) -> JobRecord:
        """``by`` asks a running job to run ``workers`` workers (its runner acts on it)."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be an integer of at least 1, got {workers!r}")
        with self.write() as conn:
            job = self._get(conn, job_id)
            if job.state not in ACTIVE:
                raise JobStateError(f"job {job_id} is {job.state}: only a starting or running job can be scaled")
            now = self._clock()
            conn.execute("UPDATE jobs SET workers_target = ?, updated_at = ? WHERE id = ?", (workers, now, job_id))
            self._event(conn, job_id, now, "scale", f"{by} asked for {workers} worker(s)")
            return self._get(conn, job_id)

    def transition(self, job_id: int, new_state: JobState | str, *, expected: JobState | str | None = None,
                   reason: str | None = None, pid: int | None = None, logdir: str | None = None) -> JobRecord:
        """Move a job to ``new_state`` if the table allows it from its current state, and (if given) only if
        it is still in ``expected``: the compare-and-set that stops two actors acting on one stale read.
        ``reason``, ``pid`` and ``logdir`` are stored when given. Raises JobStateError, changing nothing."""
        new_state = _state(new_state)
        expected = None if expected is None else _state(expected)
        with self.write() as conn:
            return self._move(conn, self._get(conn, job_id), new_state, expected=expected, reason=reason,
                              pid=pid, logdir=logdir)

    def claim_next_queued(self) -> JobRecord | None:
        """Move the oldest queued job to starting and return it; None if none is queued. Atomic across
        threads and processes: each queued job is claimed by exactly one caller, so it starts once."""
        with self.write() as conn:
            row = conn.execute("SELECT id FROM jobs WHERE state = ? ORDER BY id LIMIT 1",
                               (JobState.QUEUED.value,)).fetchone()
            if row is None:
                return None
            return self._move(conn, self._get(conn, row[0]), JobState.STARTING, expected=JobState.QUEUED)

    def recover(self, lost_because: Callable[[JobRecord], str | None]) -> list[JobRecord]:
        """At service start: every starting/running job for which ``lost_because(job)`` gives a reason
        (its supervisor is gone) becomes lost with that reason; the others are returned, to be re-attached.
        ``lost_because`` should make sure a pid is still the supervisor's (pids are reused)."""
        survivors = []
        with self.write() as conn:
            for job in self._select(conn, "state IN (?, ?)", [state.value for state in ACTIVE]):
                reason = lost_because(job)
                if reason is None:
                    survivors.append(job)
                else:
                    self._move(conn, job, JobState.LOST, expected=job.state, reason=reason)
        return survivors

    def count_restart(self, job_id: int, text: str) -> JobRecord:
        """Its supervisor restarted a task: one more restart, and the event saying which and why."""
        with self.write() as conn:
            job = self._get(conn, job_id)
            if job.state not in ACTIVE:
                raise JobStateError(f"job {job_id} is {job.state}: only a starting or running job restarts tasks")
            now = self._clock()
            conn.execute("UPDATE jobs SET restarts = restarts + 1, updated_at = ? WHERE id = ?", (now, job_id))
            self._event(conn, job_id, now, "restart", text)
            return self._get(conn, job_id)

    def add_event(self, job_id: int, kind: str, text: str) -> JobEvent:
        """Append to a job's history (a log line worth keeping: re-attached, scaled, a traceback)."""
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"an event kind must be a non-empty string, got {kind!r}")
        with self.write() as conn:
            self._get(conn, job_id)
            return self._event(conn, job_id, self._clock(), kind, str(text))

    # ----- helpers (those taking conn run inside the caller's transaction)

    def _get(self, conn: sqlite3.Connection, job_id: int) -> JobRecord:
        jobs = self._select(conn, "id = ?", [job_id])
        if not jobs:
            raise JobNotFoundError(job_id)
        return jobs[0]

    def _select(self, conn: sqlite3.Connection, where: str, params: list[Any]) -> list[JobRecord]:
        rows = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE {where} ORDER BY id", params).fetchall()
        return [_record(row) for row in rows]

    def _insert(self, job_config: JobConfig, owner: str, *, restarted_from: int | None, backend: str,
                text: str) -> JobRecord:
        if not isinstance(owner, str) or not owner:
            raise ConfigError(f"a job's owner must be a non-empty string, got {owner!r}")
        try:
            config_json = json.dumps(dataclasses.asdict(job_config), sort_keys=True)
        except TypeError as exc:
            raise ConfigError(f"the job's settings must be plain values (text, numbers, lists, maps): {exc}") from None
        with self.write() as conn:
            now = self._clock()
            job_id = conn.execute(
                "INSERT INTO jobs (name, owner, config, state, created_at, updated_at, restarted_from, backend) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_config.job_name, owner, config_json, JobState.QUEUED.value, now, now, restarted_from,
                 backend)).lastrowid
            self._event(conn, job_id, now, "submitted", text)
            if restarted_from is not None:
                self._event(conn, restarted_from, now, "cloned", f"cloned as job {job_id} by {owner}")
            return self._get(conn, job_id)

    def _move(self, conn: sqlite3.Connection, job: JobRecord, new_state: JobState, *,
              expected: JobState | None = None, reason: str | None = None, pid: int | None = None,
              logdir: str | None = None) -> JobRecord:
        if expected is not None and job.state != expected:
            raise JobStateError(f"job {job.id} is {job.state}, not {expected} any more: not moved to {new_state}")
        if new_state not in TRANSITIONS[job.state]:
            allowed = ", ".join(sorted(TRANSITIONS[job.state])) or "nothing, it has finished"
            raise JobStateError(f"job {job.id} cannot go from {job.state} to {new_state} "
                                f"(from {job.state} it may go to: {allowed})")
        now = self._clock()
        updates: dict[str, Any] = {"state": new_state.value, "updated_at": now}
        if new_state is JobState.STARTING:
            updates["started_at"] = now
        if new_state in TERMINAL:
            updates["finished_at"] = now
        for column, value in (("reason", reason), ("pid", pid), ("logdir", logdir)):
            if value is not None:
                updates[column] = value
        sets = ", ".join(f"{column} = ?" for column in updates)
        changed = conn.execute(f"UPDATE jobs SET {sets} WHERE id = ? AND state = ?",
                               [*updates.values(), job.id, job.state.value]).rowcount
        if changed != 1:  # cannot happen under BEGIN IMMEDIATE; the compare-and-set is the guarantee anyway
            raise JobStateError(f"job {job.id} left {job.state} meanwhile: not moved to {new_state}")
        self._event(conn, job.id, now, "state", f"{job.state} -> {new_state}" + (f": {reason}" if reason else ""))
        return self._get(conn, job.id)

    def _event(self, conn: sqlite3.Connection, job_id: int, now: float, kind: str, text: str) -> JobEvent:
        event_id = conn.execute("INSERT INTO events (job_id, time, kind, text) VALUES (?, ?, ?, ?)",
                                (job_id, now, kind, text)).lastrowid
        return JobEvent(event_id, job_id, now, kind, text)


def _backend(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not valid: use one of {', '.join(BACKENDS)}")
    return name


def _state(value: JobState | str) -> JobState:
    try:
        return JobState(value)
    except ValueError:
        raise ConfigError(f"unknown job state {value!r}; valid: {', '.join(JobState)}") from None


def _job_config(config: JobConfig | Mapping[str, Any]) -> JobConfig:
    """A copy of ``config`` as a JobConfig; unknown or missing fields are ConfigErrors."""
    if isinstance(config, JobConfig):
        return JobConfig(**dataclasses.asdict(config))
    if not isinstance(config, Mapping):
        raise ConfigError(f"a job's settings must be a JobConfig or a mapping of its fields, "
                          f"got {type(config).__name__}")
    unknown = sorted(set(config) - FIELDS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(map(str, unknown))}; valid: {', '.join(sorted(FIELDS))}")
    if "script" not in config:
        raise ConfigError("no script: a job needs 'script: path/to/train.py'")
    return JobConfig(**config)


def _record(row: tuple) -> JobRecord:
    values = dict(zip((f.name for f in dataclasses.fields(JobRecord)), row))
    values["config"] = json.loads(values["config"])
    values["state"] = JobState(values["state"])
    return JobRecord(**values)
