"""The coordinator of in-graph replication, as TensorFlow 2's ``ClusterCoordinator``: ``schedule`` a remote
function on whichever worker is free and get a ``RemoteValue``; ``join`` waits for all; per-worker datasets are
built on each worker, by the script's own function.

One thread per worker takes the next scheduled closure from one queue, so a slow worker takes fewer. A worker
that cannot be reached (it died, or restarts) gives its closure back to the queue, for another worker, and is
tried again every ``REJOIN_S``: a restarted worker rejoins, building its per-worker values again first. An error
a function raised on a worker is that closure's: ``fetch`` and ``join`` raise it (``RemoteError``, with the
worker's traceback), and the other closures go on.

Given the coordinator's ``TrainingSession`` (``run_coordinated`` does), the coordinator also does what a chief that
trains would: the session's hooks see every closure that trained (checkpoints, summaries, ``StopAtStepHook``:
``should_stop``), and a thread watches the ps: one lost or restarted empty has the session restore the latest
checkpoint onto every shard (``TrainingSession.recover``), while the workers' steps wait for it. In synchronous
training every closure runs on every worker at once (one step of N replicas: ``fetch`` gives the N results).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.coordinator import remote
from tensorfleet.errors import (DeadlineExceededError, InvalidArgumentError, TensorfleetError, UnavailableError,
                                UnprovenServerError)
from tensorfleet.protocol.closures import PerWorker, RunReply, RunRequest, pack, unpack
from tensorfleet.protocol.status import PsStatus
from tensorfleet.train.hooks import StepResult
from tensorfleet.wire.rpc import Channel, WireOptions

if TYPE_CHECKING:
    from tensorfleet.train.session import TrainingSession

log = logging.getLogger(__name__)

REJOIN_S = 1.0  # how often a worker that could not be reached is tried again
WATCH_PS_S = 1.0  # how often the ps are asked whether they still hold the model
START_WAIT_S = 120.0  # how long a per-worker value waits for a worker still starting
SHUTDOWN_WAIT_S = 30.0  # at shutdown, how long a worker's thread may take to finish the closure it runs
RUN_TIMEOUT_S = 3600.0  # one closure's deadline on its worker


class RemoteError(TensorfleetError):
    """A remote function raised on its worker; the message holds the worker's traceback."""


class CancelledError(TensorfleetError):
    """The coordinator shut down before a worker took the closure."""


@dataclass
class _Closure:
    function: str
    args: Sequence[Any]
    value: "RemoteValue" = field(default_factory=lambda: RemoteValue())
    tries: int = 0
    worker: "_Worker | None" = None  # the one worker that must run it (synchronous training), or any


class RemoteValue:
    """The result of a scheduled closure, once a worker has run it (``fetch`` waits for it)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: Exception | None = None
        self.worker: str | None = None  # the task that ran it

    def _set(self, result: Any = None, error: Exception | None = None, worker: str | None = None) -> None:
        self._result, self._error, self.worker = result, error, worker
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def fetch(self, timeout_s: float | None = None) -> Any:
        """The closure's result. Raises the error it raised on its worker (``RemoteError``), or
        DeadlineExceededError after ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise DeadlineExceededError(f"the closure did not finish within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self._result


class RemoteValues(RemoteValue):
    """The results of a closure run on every worker (synchronous training): ``fetch`` gives them in task order."""

    def __init__(self, parts: Sequence[RemoteValue]) -> None:
        super().__init__()
        self.parts = list(parts)

    @property
    def workers(self) -> list[str | None]:
        return [part.worker for part in self.parts]

    def done(self) -> bool:
        return all(part.done() for part in self.parts)

    def fetch(self, timeout_s: float | None = None) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [part.fetch(None if deadline is None else max(deadline - time.monotonic(), 0.0))
                for part in self.parts]


class Coordinator:
    """Drives the workers of ``cluster`` (every ``worker`` task; the coordinator is its ``chief``).

    Args:
        cluster: the job's cluster.
        session: the coordinator's own ``TrainingSession`` (entered: the ps initialized or restored). With it,
            its hooks follow the closures' training, a lost ps is restored from the latest checkpoint, and a
            synchronous job runs each closure on every worker. None: only scheduling (and asynchronous).
        max_pending: ``schedule`` waits while this many closures are scheduled and not finished (a driver that
            schedules until ``should_stop`` keeps this many ahead). None: no bound.
        options: the wire options of the channels to the workers.
    """

    def __init__(self, cluster: ClusterSpec, *, session: "TrainingSession | None" = None,
                 max_pending: int | None = None, options: WireOptions | None = None) -> None:
        self.options = options or WireOptions()
        addresses = list(cluster.jobs.get("worker", ()))
        if not addresses:
            raise TensorfleetError("the cluster has no worker for the coordinator to drive")
        if max_pending is not None and max_pending < 1:
            raise InvalidArgumentError(f"max_pending={max_pending} must be at least 1 (or None: no bound)")
        self.session, self.max_pending = session, max_pending
        self.replicated = session is not None and session.replica.sync is not None  # sync: every worker, each step
        self._queue: queue.Queue[_Closure | None] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._errors: list[Exception] = []
        self._per_worker: list[tuple[str, str, Sequence[Any]]] = []  # (name, function, args), made on each worker
        self._names = itertools.count()
        self._stopping = threading.Event()
        self._hooks = threading.Lock()  # the session's hooks and its recovery, one at a time
        self._closures_trained = 0
        self._workers = [_Worker(self, f"/job:worker/task:{i}", address) for i, address in enumerate(addresses)]
        for worker in self._workers:
            worker.start()
        self._watch = None
        if session is not None:
            self._watch = threading.Thread(target=self._watch_ps, name="coordinator-ps-watch", daemon=True)
            self._watch.start()

    # --- what a script does ---------------------------------------------------------------------------

    def schedule(self, function: Callable[..., Any], args: Sequence[Any] = ()) -> RemoteValue:
        """Run ``function(*args)`` (a ``@tfl.remote`` function) on a free worker; its result comes as a
        ``RemoteValue``. Per-worker values among ``args`` are each worker's own. Synchronous training runs it on
        every worker at once (a ``RemoteValues``: one result per worker). Waits while ``max_pending`` closures
        are pending."""
        pack(list(args), {}, "arg")  # what cannot travel fails here, not on a worker thread
        name = remote.name_of(function)
        closures = ([_Closure(name, list(args), worker=worker) for worker in self._workers] if self.replicated
                    else [_Closure(name, list(args))])
        with self._idle:
            if self.max_pending is not None:
                self._idle.wait_for(lambda: self._pending + len(closures) <= max(self.max_pending, len(closures)))
            self._pending += len(closures)
        for closure in closures:
            (closure.worker.queue if closure.worker is not None else self._queue).put(closure)
        return RemoteValues([c.value for c in closures]) if self.replicated else closures[0].value

    def create_per_worker_dataset(self, function: Callable[..., Any], args: Sequence[Any] = ()) -> PerWorker:
        """Have every worker call ``function(*args)`` (a ``@tfl.remote`` function building its data, an iterator
        say) and keep what it returns; the value is each worker's own when passed to ``schedule``. Returns once
        every worker has it (a worker that rejoins later builds it again first)."""
        name = f"per_worker_{next(self._names)}"
        entry = (name, remote.name_of(function), list(args))
        self._per_worker.append(entry)
        values = [worker.make(entry) for worker in self._workers]
        for value in values:
            value.fetch()
        return PerWorker(name)

    def join(self) -> None:
        """Wait until every scheduled closure has run; raise the first error one raised (``RemoteError``)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
            if self._errors:
                error, self._errors = self._errors[0], []
                raise error

    def done(self) -> bool:
        """Whether every scheduled closure has run (errors are ``join``'s to raise)."""
        with self._idle:
            return self._pending == 0

    def should_stop(self) -> bool:
        """Whether the session's hooks asked training to stop (``StopAtStepHook`` at its step, say)."""
        return self.session is not None and self.session.should_stop()

    def shutdown(self, *, wait: bool = True) -> None:
        """Tell every worker there is no more work (``Done``) and stop the threads: after every closure ran
        (``wait``, raising as ``join`` does), or at once, the closures not started cancelled (their values raise
        ``CancelledError``; one running on a worker finishes there) - what a driver that failed does."""
        try:
            if wait:
                self.join()
            else:
                self._cancel_queued()
        finally:
            self._stopping.set()
            for worker in self._workers:
                self._queue.put(None)
                worker.queue.put(None)
            for worker in self._workers:
                worker.join(timeout=SHUTDOWN_WAIT_S)
                worker.say_done()
            if self._watch is not None:
                self._watch.join(timeout=SHUTDOWN_WAIT_S)

    def _cancel_queued(self) -> None:
        for source in [self._queue, *(worker.queue for worker in self._workers)]:
            while True:
                try:
                    closure = source.get_nowait()
                except queue.Empty:
                    break
                if closure is not None:
                    error = CancelledError(f"{closure.function} was cancelled: the coordinator shut down before a "
                                           "worker took it")
                    closure.value._set(error=error)
                    self._finished(closure, None)

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        self.shutdown(wait=exc_type is None)

    # --- the workers' threads --------------------------------------------------------------------------

    def _finished(self, closure: _Closure, error: Exception | None) -> None:
        with self._idle:
            self._pending -= 1
            if error is not None:
                self._errors.append(error)
            self._idle.notify_all()

    def _after_closure(self, reply: RunReply, seconds: float) -> None:
        """The session's hooks see a closure that trained as one step (before its value counts as finished, so
        that ``join`` returns after the hooks it caused, a checkpoint say)."""
        trained = reply.trained
        if self.session is None or not trained.steps:
            return
        with self._hooks:
            self._closures_trained += 1
            result = StepResult(loss=trained.loss if trained.loss is not None else float("nan"),
                                global_step=trained.global_step, local_step=self._closures_trained,
                                seconds=seconds, batch_size=trained.batch_size or None, dropped=False,
                                skipped=False)
            try:
                self.session.after_remote_steps(result)
            except Exception:  # noqa: BLE001 - a hook's failure must not lose the closure's own outcome
                log.exception("a hook failed after a closure at global step %d", trained.global_step)

    def _watch_ps(self) -> None:
        """Every ``WATCH_PS_S``, ask each ps whether it holds the model; one lost or restarted empty has the
        session restore every shard from the latest checkpoint (the workers' steps wait for that)."""
        assert self.session is not None
        channels = self.session.replica.client.channels
        while not self._stopping.wait(WATCH_PS_S):
            lost = None
            for channel in channels:
                try:
                    if not PsStatus.from_meta(channel.call("Status", timeout=WATCH_PS_S * 5)[0]).initialized:
                        lost = f"{channel.task} restarted empty"
                except (UnavailableError, DeadlineExceededError, UnprovenServerError) as exc:
                    lost = f"{channel.task} does not answer ({type(exc).__name__})"
                if lost:
                    break
            if lost and not self._stopping.is_set():
                log.warning("coordinator: %s: restoring the ps", lost)
                with self._hooks:
                    try:
                        self.session.recover()
                    except TensorfleetError as exc:
                        log.error("coordinator: the ps could not be restored (%s); trying again", exc)


class _Worker(threading.Thread):
    """One worker as the coordinator sees it: a thread that runs closures there, from the coordinator's queue
    (asynchronous training: whichever worker is free) or from its own (synchronous: every worker runs each)."""

    def __init__(self, coordinator: Coordinator, task: str, address: str) -> None:
        super().__init__(name=f"coordinator-{task}", daemon=True)
        self.coordinator, self.task = coordinator, task
        self.channel = Channel(address, task=task, options=coordinator.options)
        self.made: set[str] = set()  # the per-worker values this incarnation of the worker holds
        self.queue: queue.Queue[_Closure | None] = queue.Queue() if coordinator.replicated else coordinator._queue
        # Synchronous training: the closure this worker lost (run again before any later one), and the global
        # step its current closure began at (where its previous closure ended), for the run again to skip the
        # steps already pushed (``RunRequest.began_at_step``).
        self._again: _Closure | None = None
        self.began = coordinator.session.global_step if coordinator.session is not None else 0

    def make(self, entry: tuple[str, str, Sequence[Any]]) -> RemoteValue:
        """Build per-worker value ``entry`` there now (from the caller's thread), waiting up to ``START_WAIT_S``
        for the worker to answer; one that does not builds it when it rejoins (``_rebuild_if_restarted``)."""
        value = RemoteValue()
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                self._keep(entry)
                value._set(worker=self.task)
                return value
            except (UnavailableError, DeadlineExceededError, UnprovenServerError) as exc:
                if time.monotonic() > deadline:
                    log.warning("%s did not answer within %g s (%s): it builds %s when it rejoins", self.task,
                                START_WAIT_S, exc, entry[0])
                    value._set(worker=self.task)
                    return value
                self.channel.reconnect()
                time.sleep(REJOIN_S)  # not up yet, or restarting

    def run(self) -> None:
        while True:
            closure, self._again = self._again, None
            if closure is None:
                closure = self.queue.get()
            if closure is None:
                return
            self._run_one(closure)

    def _run_one(self, closure: _Closure) -> None:
        """Run ``closure`` here and settle its value, or give it back to the queue if the worker is gone (to
        another worker; a closure of this worker's own waits for it to rejoin)."""
        started = time.monotonic()
        try:
            self._rebuild_if_restarted()
            tensors: dict[str, Any] = {}
            began = self.began if closure.tries and closure.worker is self else None
            request = RunRequest(closure.function, pack(list(closure.args), tensors, "arg"), began_at_step=began)
            reply, out = self._call(request, tensors)
        except (UnavailableError, DeadlineExceededError, UnprovenServerError) as exc:
            # gone, or what answers at its address is not it (a squatter: it was sent nothing, and its word is not
            # taken): the closure runs elsewhere, or here once the worker itself answers again
            closure.tries += 1
            self.made.clear()  # a worker that comes back is a new process: its kept values are gone
            if self.coordinator._stopping.is_set():  # shut down at once (wait=False): nothing more is retried
                error = CancelledError(f"{closure.function} was cancelled: the coordinator shut down while "
                                       f"{self.task} could not be reached ({exc})")
                closure.value._set(error=error)
                self.coordinator._finished(closure, None)
                return
            log.warning("%s could not run %s (%s): back to the queue, for %s", self.task, closure.function, exc,
                        "it when it rejoins (before any later closure)" if closure.worker is self
                        else "another worker")
            if closure.worker is self:  # its partners wait in this very closure: it comes first
                self._again = closure
            else:
                self.queue.put(closure)
            self.channel.reconnect()
            time.sleep(REJOIN_S)
            return
        except TensorfleetError as exc:  # refused (unknown function, bad argument): the closure's error
            closure.value._set(error=exc, worker=self.task)
            self.coordinator._finished(closure, exc)
            return
        if reply.trained.steps:
            self.began = reply.trained.global_step  # where this worker's next closure begins
        self.coordinator._after_closure(reply, time.monotonic() - started)
        if reply.error is not None:
            error = RemoteError(f"{closure.function} raised {reply.error_type} on {self.task}:\n{reply.error}")
            closure.value._set(error=error, worker=self.task)
            self.coordinator._finished(closure, error)
        else:
            closure.value._set(unpack(reply.result, out), worker=self.task)
            self.coordinator._finished(closure, None)

    def _rebuild_if_restarted(self) -> None:
        for entry in self.coordinator._per_worker:
            if entry[0] not in self.made:
                self._keep(entry)

    def _keep(self, entry: tuple[str, str, Sequence[Any]]) -> None:
        """Have the worker run per-worker entry (name, function, args) and keep its result under the name."""
        self._call(RunRequest(entry[1], pack(list(entry[2]), {}, "arg"), keep_as=entry[0]), {})
        self.made.add(entry[0])

    def _call(self, request: RunRequest, tensors: dict[str, Any]) -> tuple[RunReply, dict[str, Any]]:
        meta, out = self.channel.call("Run", request.to_meta(), tensors, timeout=RUN_TIMEOUT_S,
                                      wait_for_ready=False)
        return RunReply.from_meta(meta), out

    def say_done(self) -> None:
        try:
            self.channel.call("Done", {}, timeout=10.0)
        except TensorfleetError as exc:
            log.warning("%s did not take Done (%s): it may already be gone", self.task, exc)
        self.channel.close()
