"""The fleet as the launcher and the dashboard see it: every task's Status RPC, polled about once a second.

``FleetMonitor.picture()`` is the one picture every view reads (the progress line,
the dashboard page, ``/metrics``): the job's global step, target, steps and examples
per second, ETA and dropped stale gradients; each task's role, address, state,
restarts, step, loss and heartbeat age; and a bounded history for the charts.  A job
with embedding tables also has each ps shard's rows, bytes and rows created per
second per table, each worker's unique ids in its last push, and the job's total rows
and rows created per second (jobs without tables have None there).

With a ``Supervisor`` (inside ``tensorfleet launch``) task states come from it: it
knows restarting, done and failed.  Without one (``tensorfleet dashboard`` attached
to a running fleet) a task is running while it answers; done once its Status said so
or a ps reports its Done (a finished ps answers "done" a little longer for this); and
unreachable when it stops without either.  Once every task is done the job has
succeeded, and the monitor stops polling: nothing will change any more.  A scaled job
changes its fleet (``set_cluster``): added workers are polled from then on, removed ones
leave the picture.

Rates (and so the ETA) are measured from the first poll that saw training under way
(global step > 0), and only once ``MIN_RATE_SPAN_S`` of it is in the window: start-up
at step 0 would otherwise make the first estimates far too slow.  A counter that went
down (a restarted task) restarts its rate: a ps's rows created are counted from the
sample that saw it drop.

A task's Status answer is data from the network: it is read leniently into the protocol's
``PsStatus`` or ``WorkerStatus`` (by the task's role in the cluster, not what it says), where
each field must have its type and range (a count is a whole number from 0 to 2**63-1, a loss
a finite number, a state a short string, ``tables`` an object of objects of counts), or it is
taken as absent (None) for that task; a task that answers junk is still running.  The first
bad value of each field from each task is logged as a warning, later ones are not.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.dashboard.picture import FleetPicture, HistoryPoint, JobPicture, TablePart, TaskPicture
from tensorfleet.errors import TensorfleetError, UnauthenticatedError
from tensorfleet.launch.supervisor import Supervisor
from tensorfleet.protocol.status import PsStatus, WorkerStatus
from tensorfleet.wire.rpc import Channel, WireOptions
from tensorfleet.worker.status import final_status_path

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0  # rates are averaged over this much history
MIN_RATE_SPAN_S = 2.0  # no rate, nor ETA, from less training than this
_NO_RATES: dict[str, Any] = {"steps": None, "examples": None, "per_task": {}, "rows": {}}
HISTORY_POINTS = 1800  # half an hour at one poll a second


@dataclass
class _Seen:
    """The last Status a task answered, and when (monotonic)."""

    status: PsStatus | WorkerStatus | None = None
    at: float | None = None
    ever: bool = False
    final: bool = False  # the status is the one the task left as it exited
    refused: str | None = None  # why the task refused the last Status call (no or a wrong job token)


def task_role(cluster: ClusterSpec, task: TaskSpec) -> str:
    if task.job_name == "ps":
        return "ps"
    return "chief" if cluster.is_chief(task) else "worker"


def fleet_tasks(cluster: ClusterSpec) -> list[TaskSpec]:
    """Every task, ps first: the order tasks start in and are listed in."""
    return [TaskSpec("ps", i) for i in range(cluster.num_tasks("ps"))] + list(cluster.replicas)


class FleetMonitor:
    """Polls every task's Status in a background thread and keeps the picture views read.

    Args:
        cluster: the fleet.
        job_name: shown in the views.
        mode: "sync" / "async" when the launcher knows it (otherwise learned from the ps).
        supervisor: the launcher's, for task states, pids, restarts and exit codes.
        interval_s: seconds between polls.
        final_status_dir: where tasks leave their last Status as they exit (the launcher's logdir).
        options: carries the job's token, which every task requires.
        on_refused: called once (from the polling thread) with the task names and the reason when tasks first
            refuse the monitor's Status calls: it lacks the job's token, and nothing it shows will ever change.
    """

    def __init__(self, cluster: ClusterSpec, *, job_name: str, mode: str | None = None,
                 supervisor: Supervisor | None = None, interval_s: float = 1.0,
                 final_status_dir: Path | None = None, options: WireOptions | None = None,
                 on_refused: Callable[[list[str], str], None] | None = None) -> None:
        options = options or WireOptions()  # from the environment now, not when the module loaded
        self.cluster, self.job_name, self.mode = cluster, job_name, mode
        self._options = options
        self.supervisor = supervisor
        self.final_status_dir = final_status_dir
        self.interval_s = interval_s
        self.on_refused = on_refused
        self._told_refused = False
        self.tasks = fleet_tasks(cluster)
        self._channels = {t.short: Channel(cluster.task_address(t.job_name, t.index), task=t.name, options=options)
                          for t in self.tasks}
        self._seen = {t.short: _Seen() for t in self.tasks}
        self._ps = {t.short for t in self.tasks if t.job_name == "ps"}  # roles from the cluster, not the answers
        self._warned: set[tuple[str, str]] = set()  # (task, field) whose junk was logged once already
        self._history: collections.deque[HistoryPoint] = collections.deque(maxlen=HISTORY_POINTS)
        # (when, global step, examples per worker, rows created per (ps task, table))
        self._samples: collections.deque[tuple[float, int, dict[str, int], dict[tuple[str, str], int]]] = \
            collections.deque()
        self._closed_later: list[Channel] = []  # channels of tasks scaled away, closed at stop (a poll may use one)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.monotonic()
        self.ended: float | None = None  # when an attached monitor saw every task done
        self.job_state = "running"

    def set_cluster(self, cluster: ClusterSpec) -> None:
        """The fleet after a scale-up or down: new tasks are polled from now on, removed ones no longer shown.

        With a supervisor, every task of ``cluster`` must have its record there already.
        """
        with self._lock:
            tasks = fleet_tasks(cluster)
            channels, seen = {}, {}
            for t in tasks:
                address = cluster.task_address(t.job_name, t.index)
                old = self._channels.get(t.short)
                if old is not None and old.address == address:
                    channels[t.short], seen[t.short] = old, self._seen[t.short]
                else:
                    channels[t.short] = Channel(address, task=t.name, options=self._options)
                    seen[t.short] = _Seen()
            self._closed_later += [c for name, c in self._channels.items() if channels.get(name) is not c]
            # New dicts, not changed ones: a poll running now goes on with the ones it took.
            self.cluster, self.tasks, self._channels, self._seen = cluster, tasks, channels, seen

    # --- polling ------------------------------------------------------------------------------

    def start(self) -> "FleetMonitor":
        self._thread = threading.Thread(target=self._run, name="fleet-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for channel in [*self._channels.values(), *self._closed_later]:
            channel.close()

    def _run(self) -> None:
        while not self._stop.is_set() and self.job_state == "running":
            self.poll()
            self._stop.wait(self.interval_s)

    def _worth_asking(self, name: str) -> bool:
        if self.supervisor is None:
            return True
        return self.supervisor.by_name[name].state in ("starting", "running")

    def poll(self, timeout_s: float = 0.8) -> None:
        """Ask every task once (concurrently), then update the picture."""
        asked = time.monotonic()
        pending = {name: (channel, channel.call_async("Status", timeout=timeout_s))
                   for name, channel in list(self._channels.items()) if self._worth_asking(name)}
        answers: dict[str, dict[str, Any]] = {}
        refused: dict[str, str] = {}
        for name, (channel, future) in pending.items():
            try:
                answers[name] = future.result()[0]
            except UnauthenticatedError as exc:
                refused[name] = exc.message
            except TensorfleetError:
                # A restarted task: do not wait on the dead connection. The channel asked, which a scale may
                # have replaced or dropped meanwhile (set_cluster, from the launcher's thread): a leaver's
                # failed answer then names a task no longer here, and is not looked up (a KeyError there ended
                # this thread, and the picture stayed as it was for the rest of the job).
                if self._channels.get(name) is channel:
                    channel.reconnect()
        answers.update(self._final_statuses())
        self.update(answers, asked=asked)
        self._note_refusals(refused)

    def _note_refusals(self, refused: dict[str, str]) -> None:
        """Keep which tasks refused this round (an answer since clears it); tell ``on_refused`` the first time."""
        with self._lock:
            for name, seen in self._seen.items():
                if name in refused:
                    seen.refused = refused[name]
        if refused and not self._told_refused and self.on_refused is not None:
            self._told_refused = True
            self.on_refused(sorted(refused), next(iter(refused.values())))

    def update(self, answers: dict[str, Any], *, asked: float) -> None:
        """Take one round of Status answers (task name -> its reply's meta), asked at ``asked``, into the picture.

        ``poll``'s second half, public so that a picture can also be built from answers given by hand.
        """
        now = time.monotonic()
        with self._lock:
            statuses = {name: self._read(name, meta) for name, meta in answers.items()
                        if name in self._seen}  # not a task scaled away while it was asked
            for name, status in statuses.items():
                seen = self._seen[name]
                seen.status, seen.at, seen.ever, seen.refused = status, now, True, None
                if self.supervisor is not None:
                    self.supervisor.answered(name, since=asked)
            self._record(now, statuses)

    # --- what a task answered, checked ----------------------------------------------------------

    def _read(self, name: str, meta: Any) -> PsStatus | WorkerStatus:
        """``name``'s answer, typed by its role in the cluster: junk fields are None (and logged once)."""
        kind = PsStatus if name in self._ps else WorkerStatus
        return kind.read(meta, lambda field, value, expected: self._junk(name, field, value, expected))

    def _junk(self, name: str, field: str, value: Any, expected: str) -> None:
        """Log a bad value in ``name``'s Status once per (task, field): a task answers every second."""
        if (name, field) in self._warned:
            return
        self._warned.add((name, field))
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        log.warning("%s answered Status with %s=%s, not %s: taken as absent (later bad %s values from %s are "
                    "not logged)", name, field, shown, expected, field, name,
                    extra={"task_name": name, "field": field})

    def _final_statuses(self) -> dict[str, Any]:
        """The last Status of tasks that finished since the last poll, from the files they leave (read as an
        answer is: ``update`` checks it)."""
        if self.supervisor is None or self.final_status_dir is None:
            return {}
        finals = {}
        for task in self.tasks:
            record, seen = self.supervisor.by_name[task.short], self._seen.get(task.short)
            if record.state == "done" and seen is not None and not seen.final:
                path = final_status_path(self.final_status_dir, task)
                try:
                    finals[task.short] = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                seen.final = True
        return finals

    # --- the picture --------------------------------------------------------------------------

    def _ps_status(self) -> PsStatus | None:
        status = self._seen["ps:0"].status if "ps:0" in self._seen else None
        return status if isinstance(status, PsStatus) else None

    def _global_step(self) -> int:
        """The job's global step: ps:0's, which owns it.

        Workers repeat the last one ps:0 told them, which is newer when ps:0 exited between two polls. Other
        shards' steps are their own counters (a sync shard's aggregations, never advanced in async), not it.
        """
        owners = [s for name, s in self._seen.items() if name == "ps:0" or name not in self._ps]
        return max((s.status.global_step or 0 for s in owners if s.status), default=0)

    def _examples(self) -> dict[str, int]:
        """Each worker's examples so far (a worker that did not say, or said junk, has no rate)."""
        return {name: s.status.examples for name, s in self._seen.items()
                if isinstance(s.status, WorkerStatus) and s.status.examples is not None}

    def _rows_created(self) -> dict[tuple[str, str], int]:
        """Each ps shard's rows created (since it started) per table, by (task name, table name)."""
        return {(name, table): created for name, s in self._seen.items() if isinstance(s.status, PsStatus)
                for table, fields in (s.status.tables or {}).items()
                if (created := fields.rows_created) is not None}

    def _record(self, now: float, answers: dict[str, PsStatus | WorkerStatus]) -> None:
        """A history point from this round's answers; none once the job is over (they would only repeat)."""
        if self.supervisor is None and self.job_state == "running":
            if all(state == "done" for state in self._task_states(now).values()):
                self.job_state, self.ended = "succeeded", now
        if self.job_state != "running":
            return
        step, examples = self._global_step(), self._examples()
        if step > 0:  # the rate window opens when training has begun
            self._samples.append((now, step, examples, self._rows_created()))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        rates = self._rates()
        losses = [s.loss for s in answers.values() if isinstance(s, WorkerStatus) and s.loss is not None]
        self._history.append(HistoryPoint(t=round(now - self.started, 2), global_step=step,
                                          loss=sum(losses) / len(losses) if losses else None,
                                          examples_per_sec=rates["examples"], steps_per_sec=rates["steps"]))

    def _rates(self) -> dict[str, Any]:
        """Steps/s and examples/s over the window; per task too. A counter that went down (restart) restarts.

        ``rows``: rows created per second by (ps task, table)."""
        if self.job_state != "running" or len(self._samples) < 2:
            return _NO_RATES
        (t0, step0, ex0, _), (t1, step1, ex1, _) = self._samples[0], self._samples[-1]
        span = t1 - t0
        if span < MIN_RATE_SPAN_S:
            return _NO_RATES
        per_task = {name: max(ex1[name] - ex0.get(name, 0), 0) / span for name in ex1 if ex1[name] >= ex0.get(name, 0)}
        examples = sum(per_task.values()) if any(ex1.values()) else None
        return {"steps": max(step1 - step0, 0) / span, "examples": examples, "per_task": per_task,
                "rows": self._rows_rates()}

    def _rows_rates(self) -> dict[tuple[str, str], float]:
        """Rows created per second by (ps task, table), over the window, or from the last sample in it
        where the count went down (the ps restarted, counting from 0 again); none from less than
        ``MIN_RATE_SPAN_S``."""
        when, *_, last = self._samples[-1]
        rates = {}
        for key, count in last.items():
            since: tuple[float, int] | None = None  # (when, count) the rate is measured from
            previous: int | None = None
            for t, _, _, rows in self._samples:
                value = rows.get(key)
                if value is None:
                    continue
                if previous is None or value < previous:
                    since = (t, value)
                previous = value
            assert since is not None  # the last sample has the key
            span = when - since[0]
            if span >= MIN_RATE_SPAN_S:
                rates[key] = (count - since[1]) / span
        return rates

    def _reported_done(self) -> set[str]:
        """The workers some ps heard say Done: done, even though they no longer answer."""
        replicas = self.cluster.replicas
        return {replicas[i].short for s in self._seen.values() if isinstance(s.status, PsStatus)
                for i in s.status.done_replicas or () if 0 <= i < len(replicas)}

    def silent_outside(self) -> list[str]:
        """The running tasks from outside the launcher (a coordinator's Python session) that stopped answering
        their Status: a session that ended, or a notebook whose kernel died."""
        with self._lock:
            return self._silent_outside(time.monotonic())

    def _silent_outside(self, now: float) -> list[str]:
        if self.supervisor is None:
            return []
        return [name for name, seen in self._seen.items()
                if (record := self.supervisor.by_name[name]).outside and record.state == "running"
                and seen.at is not None and now - seen.at > 3 * self.interval_s + 1.0]

    def _task_states(self, now: float) -> dict[str, str]:
        """Every task's state: the supervisor's, or else what its (and the ps's) Status answers say."""
        if self.supervisor is not None:
            states = {t.short: self.supervisor.by_name[t.short].state for t in self.tasks}
            for name in self._silent_outside(now):  # no process of the launcher's: only its answers say it lives
                states[name] = "unreachable"
            return states
        reported_done, states = self._reported_done(), {}
        for name, seen in self._seen.items():
            said = seen.status.state if seen.status is not None else None
            if said == "done" or name in reported_done:
                states[name] = "done"
            elif said == "failed":  # training raised; it is on its way out
                states[name] = "failed"
            elif seen.at is not None and now - seen.at <= 3 * self.interval_s + 1.0:
                states[name] = "running"
            elif seen.refused is not None:
                states[name] = "refused"  # it is up, but will not tell this monitor anything
            else:
                states[name] = "unreachable" if seen.ever else "starting"
        return states

    def picture(self) -> FleetPicture:
        """The whole picture (the dashboard's ``/api/status`` is its ``to_json()``).

        Called a picture, not a snapshot: a ps shard's ``Snapshot`` is its state for a checkpoint."""
        now = time.monotonic()
        with self._lock:
            rates = self._rates()
            step = self._global_step()
            statuses = {name: seen.status or (PsStatus if name in self._ps else WorkerStatus).unknown()
                         for name, seen in self._seen.items()}
            states = self._task_states(now)
            ps0 = self._ps_status()
            mode = self.mode or (ps0.mode if ps0 is not None else None)
            tasks = []
            for task in self.tasks:
                name, seen = task.short, self._seen[task.short]
                status = statuses[name]
                record = self.supervisor.by_name[name] if self.supervisor is not None else None
                is_ps = task.job_name == "ps"
                if isinstance(status, PsStatus):  # a ps's own counter is the updates it applied
                    own_step, loss, unique_ids, tables = status.applied_updates, None, None, status.tables or {}
                else:  # a worker's: the steps it pushed (with embedding tables, the unique ids of its last push)
                    own_step, loss, unique_ids, tables = status.local_step, status.loss, status.unique_ids, {}
                tasks.append(TaskPicture(
                    name=name, role=task_role(self.cluster, task),
                    address=self.cluster.task_address(task.job_name, task.index),
                    state=states[name],
                    pid=record.pid if record is not None else status.pid,
                    restarts=record.restarts if record is not None else 0,
                    step=own_step,
                    # only ps:0 (or a sync shard) counts steps
                    global_step=status.global_step if not is_ps or name == "ps:0" or mode == "sync" else None,
                    loss=loss,
                    examples_per_sec=None if is_ps else rates["per_task"].get(name),
                    heartbeat_age_s=None if seen.at is None else round(now - seen.at, 2),
                    exit_code=record.exit_code if record is not None else None,
                    # embedding tables: a ps's rows per table, a worker's unique ids in its last push
                    tables={table: TablePart(rows=counts.rows, bytes=counts.bytes,
                                             rows_per_sec=rates["rows"].get((name, table)),
                                             admitted=counts.admitted, refused_updates=counts.refused_updates,
                                             evicted=counts.evicted, row_updates=counts.row_updates,
                                             lookups=counts.lookups)
                            for table, counts in tables.items()} or None,
                    unique_ids=unique_ids,
                    metrics=None if isinstance(status, PsStatus) else status.metrics,
                    problem=seen.refused,
                ))
            targets = [s.target_step for s in statuses.values() if isinstance(s, WorkerStatus) and s.target_step]
            target = max(targets) if targets else None
            steps_per_sec = rates["steps"]
            eta = ((target - step) / steps_per_sec if target is not None and steps_per_sec and step < target
                   else None)
            dropped = max((s.dropped_stale or 0 for s in statuses.values() if isinstance(s, PsStatus)), default=0)
            _add_traffic_shares(tasks)
            table_rows = [part.rows for t in tasks for part in (t.tables or {}).values() if part.rows is not None]
            job = JobPicture(
                name=self.job_name, mode=mode, state=self.job_state, global_step=step, target_step=target,
                steps_per_sec=steps_per_sec, examples_per_sec=rates["examples"], eta_s=eta, dropped_stale=dropped,
                elapsed_s=round((self.ended or now) - self.started, 2),
                restarts=self.supervisor.total_restarts if self.supervisor is not None else 0,
                table_rows=sum(table_rows) if table_rows else None,
                rows_per_sec=sum(rates["rows"].values()) if rates["rows"] else None,
                problem=_refusal_problem(tasks), metrics=job_metrics(tasks))
            return FleetPicture(job, tasks, list(self._history))


def job_metrics(tasks: list[TaskPicture]) -> dict[str, float] | None:
    """The job's final metrics: the chief's (or the coordinator's), then any other task's of a name it did not
    report (a script that evaluates on worker 1 only), in the cluster's order."""
    ordered = sorted(tasks, key=lambda task: task.role != "chief")
    metrics: dict[str, float] = {}
    for task in ordered:
        for name, value in (task.metrics or {}).items():
            metrics.setdefault(name, value)
    return metrics or None


def metrics_text(metrics: dict[str, float] | None) -> str:
    """``accuracy 0.9771, rmse 0.9114``: a job's metrics on one line (4 significant decimals)."""
    return ", ".join(f"{name} {value:.4g}" if abs(value) >= 1e4 or 0 < abs(value) < 1e-3 else f"{name} {value:.4f}"
                     for name, value in (metrics or {}).items())


def _refusal_problem(tasks: list[TaskPicture]) -> str | None:
    """What the views say when tasks refuse the monitor: it cannot show anything of them until given the token."""
    refusing = [task.name or "" for task in tasks if task.problem is not None]
    if not refusing:
        return None
    return (f"{', '.join(refusing)} refuse{'s' if len(refusing) == 1 else ''} this dashboard's Status calls: it "
            f"does not have the job's token. Start it with TENSORFLEET_TOKEN (or TENSORFLEET_TOKEN_FILE) set to "
            f"the token the tasks were started with.")


def _add_traffic_shares(tasks: list[TaskPicture]) -> None:
    """Each shard's part of its table's traffic (row updates and lookups since start): a hot shard, one far
    above 1 / shards, shows."""
    totals: dict[str, int] = {}
    for task in tasks:
        for table, part in (task.tables or {}).items():
            totals[table] = totals.get(table, 0) + _traffic(part)
    for task in tasks:
        for table, part in (task.tables or {}).items():
            total = totals.get(table, 0)
            part.traffic_share = _traffic(part) / total if total else None


def _traffic(part: TablePart) -> int:
    return (part.row_updates or 0) + (part.lookups or 0)


def progress_line(picture: FleetPicture) -> str:
    """``step 4,200/10,000 (42%) | 51,300 ex/s | 513 steps/s | ETA 11s | 3/3 tasks running | 1 restart``"""
    job = picture.job
    step, target = job.global_step or 0, job.target_step
    parts = [f"step {step:,}/{target:,} ({100 * step / target:.0f}%)" if target else f"step {step:,}"]
    if job.examples_per_sec is not None:
        parts.append(f"{job.examples_per_sec:,.0f} ex/s")
    if job.steps_per_sec is not None:
        parts.append(f"{job.steps_per_sec:,.0f} steps/s")
    if job.table_rows is not None:  # a job with embedding tables
        rate = job.rows_per_sec
        parts.append(f"{job.table_rows:,} table rows" + (f" (+{rate:,.0f}/s)" if rate is not None else ""))
    if job.eta_s is not None:
        parts.append(f"ETA {format_seconds(job.eta_s)}")
    tasks = picture.tasks
    running = sum(t.state == "running" for t in tasks)
    parts.append(f"{running}/{len(tasks)} tasks running")
    others = collections.Counter(t.state or "unknown" for t in tasks if t.state not in ("running", "done"))
    parts += [f"{n} {state}" for state, n in sorted(others.items())]
    if job.restarts:
        parts.append(f"{job.restarts} restart{'s' if job.restarts != 1 else ''}")
    if job.mode == "sync" and job.dropped_stale:
        parts.append(f"{job.dropped_stale} stale dropped")
    return " | ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
