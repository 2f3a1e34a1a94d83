"""The coordinator of in-graph replication, as TensorFlow 2's ``ClusterCoordinator``: ``schedule`` a remote
function on whichever worker is free and get a ``RemoteValue``; ``join`` waits for all; per-worker datasets are
built on each worker, by the script's own function.

One thread per worker takes the next scheduled closure from one queue, so a slow worker takes fewer. A worker
that cannot be reached (it died, or restarts) gives its closure back to the queue, for another worker, and is
tried again every ``REJOIN_S``: a restarted worker rejoins, building its per-worker values again first. An error
a function raised on a worker is that closure's: ``fetch`` and ``join`` raise it (``RemoteError``, with the
worker's traceback), and the other closures go on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.coordinator import remote
from tensorfleet.errors import DeadlineExceededError, TensorfleetError, UnavailableError
from tensorfleet.protocol.closures import PerWorker, RunReply, RunRequest, pack, unpack
from tensorfleet.wire.rpc import Channel, WireOptions

log = logging.getLogger(__name__)

REJOIN_S = 1.0  # how often a worker that could not be reached is tried again
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
    keep_as: str | None = None
    value: "RemoteValue" = field(default_factory=lambda: RemoteValue())
    tries: int = 0


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


class Coordinator:
    """Drives the workers of ``cluster`` (every ``worker`` task; the coordinator is its ``chief``)."""

    def __init__(self, cluster: ClusterSpec, *, options: WireOptions | None = None) -> None:
        self.options = options or WireOptions()
        addresses = list(cluster.jobs.get("worker", ()))
        if not addresses:
            raise TensorfleetError("the cluster has no worker for the coordinator to drive")
        self._queue: queue.Queue[_Closure | None] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._errors: list[Exception] = []
        self._per_worker: list[tuple[str, str, Sequence[Any]]] = []  # (name, function, args), made on each worker
        self._names = itertools.count()
        self._stopping = False
        self._workers = [_Worker(self, f"/job:worker/task:{i}", address) for i, address in enumerate(addresses)]
        for worker in self._workers:
            worker.start()

    # --- what a script does ---------------------------------------------------------------------------

    def schedule(self, function: Callable[..., Any], args: Sequence[Any] = ()) -> RemoteValue:
        """Run ``function(*args)`` (a ``@tfl.remote`` function) on a free worker; its result comes as a
        ``RemoteValue``. Per-worker values among ``args`` are each worker's own."""
        pack(list(args), {}, "arg")  # what cannot travel fails here, not on a worker thread
        closure = _Closure(remote.name_of(function), list(args))
        with self._idle:
            self._pending += 1
        self._queue.put(closure)
        return closure.value

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

    def shutdown(self, *, wait: bool = True) -> None:
        """Tell every worker there is no more work (``Done``) and stop the threads: after every closure ran
        (``wait``, raising as ``join`` does), or at once, the closures not started cancelled (their values raise
        ``CancelledError``; one running on a worker finishes there) - what a driver that failed does."""
        if wait:
            self.join()
        else:
            self._cancel_queued()
        self._stopping = True
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join(timeout=SHUTDOWN_WAIT_S)
            worker.say_done()

    def _cancel_queued(self) -> None:
        while True:
            try:
                closure = self._queue.get_nowait()
            except queue.Empty:
                return
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


class _Worker(threading.Thread):
    """One worker as the coordinator sees it: a thread that runs the queue's closures there."""

    def __init__(self, coordinator: Coordinator, task: str, address: str) -> None:
        super().__init__(name=f"coordinator-{task}", daemon=True)
        self.coordinator, self.task = coordinator, task
        self.channel = Channel(address, task=task, options=coordinator.options)
        self.made: set[str] = set()  # the per-worker values this incarnation of the worker holds

    def make(self, entry: tuple[str, str, Sequence[Any]]) -> RemoteValue:
        """Build per-worker value ``entry`` there now (from the caller's thread), waiting up to ``START_WAIT_S``
        for the worker to answer; one that does not builds it when it rejoins (``_rebuild_if_restarted``)."""
        value = RemoteValue()
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                self._call(RunRequest(entry[1], pack(list(entry[2]), {}, "arg"), keep_as=entry[0]), {})
                self.made.add(entry[0])
                value._set(worker=self.task)
                return value
            except (UnavailableError, DeadlineExceededError) as exc:
                if time.monotonic() > deadline:
                    log.warning("%s did not answer within %g s (%s): it builds %s when it rejoins", self.task,
                                START_WAIT_S, exc, entry[0])
                    value._set(worker=self.task)
                    return value
                self.channel.reconnect()
                time.sleep(REJOIN_S)  # not up yet, or restarting

    def run(self) -> None:
        while True:
            closure = self.coordinator._queue.get()
            if closure is None:
                return
            self._run_one(closure)

    def _run_one(self, closure: _Closure) -> None:
        """Run ``closure`` here and settle its value, or give it back to the queue if the worker is gone."""
        try:
            self._rebuild_if_restarted()
            tensors: dict[str, Any] = {}
            request = RunRequest(closure.function, pack(list(closure.args), tensors, "arg"))
            reply, out = self._call(request, tensors)
        except (UnavailableError, DeadlineExceededError) as exc:
            closure.tries += 1
            log.warning("%s could not run %s (%s): back to the queue, for another worker", self.task,
                        closure.function, exc)
            self.made.clear()  # a worker that comes back is a new process: its kept values are gone
            self.coordinator._queue.put(closure)
            self.channel.reconnect()
            time.sleep(REJOIN_S)
            return
        except TensorfleetError as exc:  # refused (unknown function, bad argument): the closure's error
            closure.value._set(error=exc, worker=self.task)
            self.coordinator._finished(closure, exc)
            return
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
