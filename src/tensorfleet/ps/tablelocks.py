"""Each embedding table of a ps shard serves the requests that touch it one at a time, in the order the store
admitted them; the parts of one request on different tables run at the same time.

The store admits a request under its ordering lock (exactly once, fences, the update's number) and, under that
same hold, takes a *ticket* on each table the request touches (one counter per table): so the tickets of any two
requests are in the same order on every table they share. Then, the ordering lock released, each table's part
waits until its table serves its ticket, runs (the table is its alone then: this is the lock per table), and
lets the table serve the next ticket. Hence:

* a table applies pushes in the order they were admitted: the update numbers and exactly-once are as under
  one lock;
* a lookup of tables A and B sees on both every push admitted before it and none admitted after: no push
  half-applied, no torn row;
* parts on different tables run in parallel threads (a small pool shared by the process; the last part of a
  request runs on the calling thread, so a request of one table makes no thread hop), where the compiled
  kernels release the GIL.

No part ever waits for the ordering lock, and a caller never waits for it between ``take`` and ``finish``. So a
holder of the ordering lock may wait for the tables (``drain``, or ``finish`` under it): with no ticket issued
meanwhile, it then has every table to itself (snapshots, status, restores, the memory budget's eviction across
tables).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

SAY_WAITING_S = 30.0  # a wait for a table's turn says so in the log this often (the parts before it are stuck)

log = logging.getLogger(__name__)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> ThreadPoolExecutor:
    """The process's threads for tables' parts: they never wait for a turn (only parts whose turn came are handed
    to it), so a bounded pool cannot deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(thread_name_prefix="tensorfleet-table")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads are not there; a new pool is made when first needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


class TableTurns:
    """The turns of one shard's tables: per table name, the tickets issued and the next one served."""

    def __init__(self, task: str = "") -> None:
        self.task = task
        self._cond = threading.Condition()
        self._issued: dict[str, int] = {}
        self._served: dict[str, int] = {}

    def take(self, parts: Mapping[str, Callable[[], Any]], *, start: bool = False) -> Tickets:
        """A ticket on each table of ``parts`` (name -> its work). Call under the store's ordering lock, as the
        last thing that can fail there: every ticket taken must be ``finish``-ed, or its table stops.

        ``start``: hand the parts whose turn it is already to the pool now (the caller has other work to do
        meanwhile, e.g. the dense variables' update)."""
        if not parts:
            return Tickets(self, {}, {})
        with self._cond:
            tickets = {}
            for name in parts:
                tickets[name] = self._issued.get(name, 0)
                self._issued[name] = tickets[name] + 1
        request = Tickets(self, tickets, dict(parts))
        if start:
            request.start_ready()
        return request

    def drain(self) -> None:
        """Wait until every ticket issued was served. Under the store's ordering lock (no ticket is issued
        meanwhile), the caller then has every table to itself until it releases that lock."""
        self._wait_until(lambda: all(self._served.get(name, 0) == issued for name, issued in self._issued.items()),
                         "every table to finish the requests admitted before")

    def ready(self, waiting: Mapping[str, int], *, wait: bool) -> list[str]:
        """Of ``waiting`` (name -> ticket), the tables whose turn it is; ``wait``: until there is one."""
        def due() -> list[str]:
            return [name for name, ticket in waiting.items() if self._served.get(name, 0) == ticket]
        if not wait:
            with self._cond:
                return due()
        return self._wait_until(due, f"the turn of table(s) {', '.join(sorted(waiting))}")

    def _wait_until(self, done: Callable[[], Any], what: str) -> Any:
        """``done()`` once it is true, waited for under this object's lock; a long wait is said in the log."""
        started = time.monotonic()
        with self._cond:
            while not (result := done()):
                if not self._cond.wait(SAY_WAITING_S):
                    log.warning("%s: waited %.0f s for %s (a table's update or lookup is stuck?)", self.task,
                                time.monotonic() - started, what)
            return result

    def serve(self, name: str) -> None:
        """The part holding the table's current ticket is done: the next ticket's turn."""
        with self._cond:
            self._served[name] = self._served.get(name, 0) + 1
            self._cond.notify_all()


class Tickets:
    """One request's parts on its tables, each run at its table's turn (``TableTurns.take``)."""

    def __init__(self, turns: TableTurns, tickets: dict[str, int], parts: dict[str, Callable[[], Any]]) -> None:
        self._turns = turns
        self._waiting = tickets  # name -> ticket: the parts not handed out yet
        self._parts = parts
        self._running: dict[str, Future] = {}
        self._outcomes: dict[str, tuple[Any, BaseException | None]] = {}

    def start_ready(self) -> None:
        """Hand the parts whose turn it is now to the pool; return at once."""
        for name in self._turns.ready(self._waiting, wait=False):
            self._hand_out(name)

    def finish(self) -> dict[str, Any]:
        """Run every part not started yet at its table's turn (to the pool, the last one on this thread), wait for
        all of them, and return their results by table. Every ticket is served, whatever a part raises; the first
        error is raised after. Calling it again returns the same."""
        while self._waiting:
            ready = self._turns.ready(self._waiting, wait=True)
            for name in ready:
                self._hand_out(name, inline=len(self._waiting) == 1)  # the last one: on this thread
        for name, future in self._running.items():
            self._outcomes[name] = future.result()
        self._running = {}
        for _, error in self._outcomes.values():
            if error is not None:
                raise error
        return {name: value for name, (value, _) in self._outcomes.items()}

    def _hand_out(self, name: str, *, inline: bool = False) -> None:
        """Run the part of ``name`` (its turn came) in the pool, or ``inline`` on this thread (the last one of a
        request: no thread hop; or when the pool is gone, at the interpreter's exit)."""
        del self._waiting[name]
        if not inline:
            try:
                self._running[name] = _shared_pool().submit(self._run, name)
                return
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                pass
        self._outcomes[name] = self._run(name)

    def _run(self, name: str) -> tuple[Any, BaseException | None]:
        try:
            return self._parts[name](), None
        except BaseException as exc:  # given to ``finish``'s caller, after every other part ran
            return None, exc
        finally:
            self._turns.serve(name)
